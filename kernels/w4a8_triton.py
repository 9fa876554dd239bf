"""SVDQuant W4A8 on fp8 tensor cores (Hopper): the stored int4 weights turned into e4m3 inside the GEMM.

Two kernels per linear, and no expanded weight buffer (SVDQuant on sm_90, which has fp8 but no 4-bit
tensor cores). The arithmetic is ``dit_passes.quant.w4a8`` (the executable specification), step by step:

1. :func:`w4a8_act_quant`, one program per ``BLOCK_M`` tokens, reading x twice in a row (the second pass finds
   the rows in L2): ``x_s = x.float() * smooth_inv``; ``sx = div_rn(amax|x_s|, 448)`` per token (a zero scale
   becomes 1); ``qx = e4m3(clamp(x_s * div_rn(1, sx), -448, 448))`` (round to nearest even); and the low-rank down
   projection ``lora_act = x_s.to(x.dtype) @ lora_down.T`` (fp32 accumulation) in the same pass. ``qx`` is stored in
   the GEMM's order: inside each K-group of 64, the 32 even k first, then the 32 odd k (the packed weight's low and
   high nibbles), so that the GEMM multiplies nibble planes by contiguous activation halves with no register
   shuffle (a dot is a sum: permuting A and B alike inside a group changes nothing).
2. :func:`w4a8_gemm`: per K-group, the packed bytes [BLOCK_N, 32] are loaded, split into nibble planes (exact
   fp16 / fp32 values by a bit trick, :func:`_nibble_planes`) and converted to e4m3 in registers, then

   * ``fold=False`` (exact weights, the default): ``d = qx_g @ q_g.T`` on fp8 tensor cores (int4 values are exact
     in e4m3; fp32 group sums), ``acc += d * wscale[n, g]``; at the end ``y = acc * sx[m]``;
   * ``fold=True``: the group scale goes into the weight before the MMA, as ``graph_forms.w4_to_e4m3`` does it:
     ``w8 = e4m3(clamp(q * (wscale[n, g] / sw[n]), -448, 448))`` with ``sw[n] = 8 * max_g wscale[n, g] / 448``
     (:func:`fold_row_scale`, one small launch per call), one fp32 accumulator over all of K (no per-group fp32
     epilogue), ``y = acc * sx[m] * sw[n]``;

   then the low-rank up projection ``y += lora_act @ lora_up.T`` (a K=rank tensor-core dot: tf32, full fp32 for an
   fp32 output) and ``y += bias`` in the epilogue, stored in x.dtype.

Rows / columns past M / N are clamped (``% M``) for the loads, so the main loop has no masks; only the store is
masked. Under ``TRITON_INTERPRET=1`` (CPU tests) the fp32 -> e4m3 rounding is done by :func:`_soft_e4m3` (the
interpreter's own cast mis-rounds values that carry into the next binade); on the GPU the hardware cast (RNE,
saturating) is used; both give the e4m3 value torch's ``.to(float8_e4m3fn)`` gives.

Public: :func:`w4a8_act_quant`, :func:`w4a8_gemm`, :func:`w4a8_linear`, :func:`is_supported`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from .w4a4_autotune import W4A8_INTERPRET_GEMM, interpreting, w4a8_act_configs, w4a8_gemm_configs, w4a8_prune
from .w4a4_triton import _bucket, _r_pad, _round_to_bf16_rne, grouped_tile
from .w4a4_triton import _check_device as _check_device_w4a4

GROUP = 64
FP8_MAX = 448.0
E4M3_MAX = tl.constexpr(FP8_MAX)  # what the kernels read (a jit function sees only constexpr globals)
_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _soft_e4m3(v):
    """fp32 (|v| <= 448) -> the nearest e4m3 value (ties to even) as fp32: 3 mantissa bits kept by integer
    rounding of the fp32 bits for normals, a magic-number add (quantum 2**-9) for e4m3 subnormals (< 2**-6)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    sub = (v + 24576.0) - 24576.0  # 1.5 * 2**23 * 2**-9: rounds to multiples of 2**-9, half to even
    return tl.where(tl.abs(v) < 0.015625, sub, bits.to(tl.float32, bitcast=True))


@triton.jit
def _to_e4m3(v, SOFT: tl.constexpr):
    if SOFT:
        v = _soft_e4m3(v.to(tl.float32))
    return v.to(tl.float8e4nv)


@triton.autotune(configs=w4a8_act_configs(), key=["M_BUCKET", "K", "R_PAD", "CHUNK"])
@triton.jit
def _w4a8_act_kernel(x_ptr, si_ptr, ld_ptr, q_ptr, sx_ptr, la_ptr, M, K, R, M_BUCKET,
                     s_xm, s_qm, s_ldr, s_lam,
                     TRIP: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr,
                     SOFT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    offs_r = tl.arange(0, R_PAD)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    lora = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    # TRIP > 0 (interpreter only) makes the trip count a compile-time constant: Triton 3.6's interpreter cannot
    # loop to a runtime bound under NumPy >= 2.3 (see w4a4_triton); on the GPU it stays K // CHUNK at run time.
    for i in range(0, TRIP if TRIP > 0 else K // CHUNK):  # pass 1: the token's abs-max and x_s @ lora_down.T
        cols = i * CHUNK + offs_c
        x = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=m_mask[:, None], other=0.0)
        xs = x.to(tl.float32) * tl.load(si_ptr + cols)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
        if HAS_LORA:
            ld = tl.load(ld_ptr + offs_r[:, None] * s_ldr + cols[None, :], mask=(offs_r < R)[:, None], other=0.0)
            # "x_s in the activation dtype": on the GPU the 16-bit cast (round to nearest even) feeds the 16-bit
            # dot; in the fp32 dot (the interpreter, fp32 x) bf16 is rounded explicitly, the interpreter's cast
            # truncating
            if DOT_F32:
                if x_ptr.dtype.element_ty == tl.bfloat16:
                    xa32 = _round_to_bf16_rne(xs)
                else:
                    xa32 = xs.to(x_ptr.dtype.element_ty).to(tl.float32)
                lora = tl.dot(xa32, tl.trans(ld.to(tl.float32)), lora, input_precision="ieee")
            else:
                lora = tl.dot(xs.to(x_ptr.dtype.element_ty), tl.trans(ld), lora)
    scale = tl.math.div_rn(amax, E4M3_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    inv = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)  # one division per token, not per element
    tl.store(sx_ptr + rows, scale, mask=m_mask)
    if HAS_LORA:
        tl.store(la_ptr + rows[:, None] * s_lam + offs_r[None, :], lora, mask=m_mask[:, None] & (offs_r < R)[None, :])
    offs_p = tl.arange(0, CHUNK // 2)
    plane_cols = (offs_p // 32) * 64 + offs_p % 32  # pair p of the chunk -> its even value's column in qx
    for i in range(0, TRIP if TRIP > 0 else K // CHUNK):  # pass 2: quantize (the rows are in L2 by now)
        cols = i * CHUNK + offs_c
        x = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=m_mask[:, None], other=0.0)
        xs = x.to(tl.float32) * tl.load(si_ptr + cols)[None, :]
        y = tl.minimum(tl.maximum(xs * inv[:, None], -E4M3_MAX), E4M3_MAX)
        # per group of 64: the 32 even k, then the 32 odd k (the weight's low / high nibbles)
        y_even, y_odd = tl.split(tl.reshape(y, [BLOCK_M, CHUNK // 2, 2]))
        dst = q_ptr + rows[:, None] * s_qm + (i * CHUNK + plane_cols)[None, :]
        tl.store(dst, _to_e4m3(y_even, SOFT), mask=m_mask[:, None])
        tl.store(dst + 32, _to_e4m3(y_odd, SOFT), mask=m_mask[:, None])


@triton.jit
def _nibble_planes(packed_u8, HALF: tl.constexpr):
    """uint8 [R, 32] -> (low nibbles, high nibbles) as exact values in [-8, 7] (even k, odd k), fp16 (``HALF``) or
    fp32, with no int -> float conversion instruction (quarter rate on sm_90, the main loop's bottleneck otherwise):
    a two's complement nibble v flipped to offset binary, ``u = v ^ 8 = v + 8`` in [0, 15], becomes the low mantissa
    bits of 1024 (fp16, ``u | 0x6400``) or 2**23 (fp32, ``u | 0x4B000000``): one xor with 0x6408 / 0x4B000008 since
    the bits do not overlap; subtracting 1032 / 2**23 + 8 leaves v exactly. fp16 pairs (HADD2) serve the exact
    weights; the folded ones multiply in fp32 (sm_90 builds: fewer instructions each way)."""
    if HALF:
        b = packed_u8.to(tl.int16)
        lo = ((b & 15) ^ 0x6408).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        hi = ((b >> 4) ^ 0x6408).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    else:
        b = packed_u8.to(tl.int32)
        lo = ((b & 15) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((b >> 4) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def _convert_group(b_ptrs, ws_ptrs, sw, g, FOLD: tl.constexpr, SOFT: tl.constexpr):
    """K-group ``g`` of the weight tile as two e4m3 nibble planes [BLOCK_N, 32] and its fp32 group scales: the int4
    values (exact), or with ``FOLD`` the values times ``wscale / sw`` rounded to e4m3. |q * ratio| <= 448 up to the
    ratio's rounding, which e4m3 rounding (saturating on the GPU) takes back to 448: the reference's clamp needs no
    instruction here."""
    lo, hi = _nibble_planes(tl.load(b_ptrs + g * 32), not FOLD)
    ws = tl.load(ws_ptrs + g).to(tl.float32)
    if FOLD:
        ratio = tl.math.div_rn(ws, sw)[:, None]
        return _to_e4m3(lo * ratio, SOFT), _to_e4m3(hi * ratio, SOFT), ws
    return _to_e4m3(lo, SOFT), _to_e4m3(hi, SOFT), ws


@triton.jit
def _w4a8_gemm_kernel(qx_ptr, sx_ptr, qw_ptr, ws_ptr, sw_ptr, la_ptr, lu_ptr, bias_ptr, out_ptr,
                      M, N, K, R, M_BUCKET, s_qxm, s_qwn, s_wsn, s_lam, s_lun, s_om,
                      TRIP: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr,
                      FOLD: tl.constexpr, SOFT: tl.constexpr, LORA_IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      PREFETCH: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # clamped rows / columns: unmasked loads in the main loop
    rn = (offs_n % N).to(tl.int64)
    offs_h = tl.arange(0, 32)
    a_ptrs = qx_ptr + rm[:, None] * s_qxm + offs_h[None, :]  # [BLOCK_M, 32] e4m3, one nibble plane of a group
    b_ptrs = qw_ptr + rn[:, None] * s_qwn + offs_h[None, :]  # [BLOCK_N, 32] packed bytes of a group
    ws_ptrs = ws_ptr + rn * s_wsn
    if FOLD:
        sw = tl.load(sw_ptr + rn)
    else:
        sw = tl.full([BLOCK_N], 1.0, tl.float32)  # unused
    # The tile is computed transposed, [BLOCK_N, BLOCK_M] = W_tile @ X_tile.T: the weight, converted in registers,
    # is then wgmma's A operand straight from registers (the activations, B, stream through the pipelined shared
    # memory); the other orientation would write each converted weight tile to shared memory and fence before the
    # MMA (sm_90 builds: 128 instead of 236 registers for 128 x 128 x 64, folded, 8 warps).
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH:
        # the next group's weights converted while this group's MMAs run (ptxas sinks the wgmma wait past that
        # independent work; sm_90 SASS: ~130 instructions inside the second MMA's window), at the price of plain
        # loads for its packed bytes instead of the cp.async pipeline's: the autotuner decides
        w_lo, w_hi, wsg = _convert_group(b_ptrs, ws_ptrs, sw, 0, FOLD, SOFT)
        for g in range(0, TRIP if TRIP > 0 else K // 64):
            a_even = tl.load(a_ptrs + g * 64)
            a_odd = tl.load(a_ptrs + g * 64 + 32)
            if FOLD:
                acc = tl.dot(w_lo, tl.trans(a_even), acc)
                acc = tl.dot(w_hi, tl.trans(a_odd), acc)
            else:
                d = tl.dot(w_lo, tl.trans(a_even))
                d = tl.dot(w_hi, tl.trans(a_odd), d)
            nxt_lo, nxt_hi, nxt_ws = _convert_group(b_ptrs, ws_ptrs, sw, tl.minimum(g + 1, K // 64 - 1), FOLD, SOFT)
            if not FOLD:
                acc = acc + d * wsg[:, None]
            w_lo, w_hi, wsg = nxt_lo, nxt_hi, nxt_ws
    else:
        for kb in range(0, TRIP if TRIP > 0 else K // BLOCK_K):
            for j in tl.static_range(BLOCK_K // 64):
                g = kb * (BLOCK_K // 64) + j
                a_even = tl.load(a_ptrs + g * 64)
                a_odd = tl.load(a_ptrs + g * 64 + 32)
                w_lo, w_hi, wsg = _convert_group(b_ptrs, ws_ptrs, sw, g, FOLD, SOFT)
                if FOLD:
                    acc = tl.dot(w_lo, tl.trans(a_even), acc)
                    acc = tl.dot(w_hi, tl.trans(a_odd), acc)
                else:  # the group's fp32 dot, then its scale
                    d = tl.dot(w_lo, tl.trans(a_even))
                    d = tl.dot(w_hi, tl.trans(a_odd), d)
                    acc = acc + d * wsg[:, None]
    sx = tl.load(sx_ptr + rm)
    if FOLD:
        acc = acc * sx[None, :] * sw[:, None]
    else:
        acc = acc * sx[None, :]
    if HAS_LORA:
        offs_r = tl.arange(0, R_PAD)
        r_mask = (offs_r < R)[None, :]
        la = tl.load(la_ptr + rm[:, None] * s_lam + offs_r[None, :], mask=r_mask, other=0.0)
        lu = tl.load(lu_ptr + rn[:, None] * s_lun + offs_r[None, :], mask=r_mask, other=0.0).to(tl.float32)
        if LORA_IEEE:
            acc = tl.dot(lu, tl.trans(la), acc, input_precision="ieee")
        else:
            acc = tl.dot(lu, tl.trans(la), acc, input_precision="tf32")
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * s_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


@triton.jit
def _fold_scale_kernel(ws_ptr, sw_ptr, N, G, s_wsn, TRIP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)  # the group scales are positive (a zero one is stored as 1)
    for i in range(0, TRIP if TRIP > 0 else tl.cdiv(G, BLOCK_G)):
        cols = i * BLOCK_G + offs_g
        v = tl.load(ws_ptr + rows.to(tl.int64)[:, None] * s_wsn + cols[None, :],
                    mask=(rows < N)[:, None] & (cols < G)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    tl.store(sw_ptr + rows, tl.math.div_rn(amax * 8.0, E4M3_MAX), mask=rows < N)


# the autotuned launcher; an explicit config (tests, the interpreter) launches the kernel itself
_w4a8_gemm_tuned = triton.autotune(configs=w4a8_gemm_configs(),
                                   key=["M_BUCKET", "N", "K", "R_PAD", "HAS_LORA", "HAS_BIAS", "FOLD"],
                                   prune_configs_by={"early_config_prune": w4a8_prune})(_w4a8_gemm_kernel)


# ----------------------------------------------------------------------------------------- wrappers


def _check_device(name: str, *tensors: Optional[torch.Tensor]) -> torch.device:
    return _check_device_w4a4(name, *tensors, reference="dit_passes.quant.w4a8.w4a8_linear_reference")


def _chunk(k: int) -> int:
    """The activation pass's K step: the largest of 256 / 128 / 64 dividing K."""
    return next(c for c in (256, 128, 64) if k % c == 0)


def w4a8_act_quant(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel over x [..., K] (K % 64 == 0): ``(qx float8_e4m3fn [M, K] in the GEMM's nibble order (module
    docstring), sx fp32 [M] per-token scales, lora_act fp32 [M, r])``; lora_down [r, K] (r may be 0)."""
    name = "w4a8_act_quant"
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"{name}: x must be one of {_ACT_DTYPES}, got {x.dtype}")
    k = x.shape[-1]
    if k == 0 or k % GROUP:
        raise ValueError(f"{name}: K = x.shape[-1] must be a positive multiple of {GROUP}, got shape {tuple(x.shape)}")
    if smooth_inv.shape != (k,):
        raise ValueError(f"{name}: smooth_inv must have shape ({k},), got {tuple(smooth_inv.shape)}")
    if lora_down.dim() != 2 or lora_down.shape[1] != k or lora_down.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: lora_down must be a float [rank, {k}] tensor, got {lora_down.dtype} "
                         f"{tuple(lora_down.shape)}")
    dev = _check_device(name, x, smooth_inv, lora_down)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, r = x2.shape[0], lora_down.shape[0]
    qx = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    sx = torch.empty((m,), dtype=torch.float32, device=dev)
    lora_act = torch.empty((m, r), dtype=torch.float32, device=dev)
    if m == 0:
        return qx, sx, lora_act
    ld = lora_down if lora_down.stride(-1) == 1 else lora_down.contiguous()
    # 16-bit operands take the 16-bit tensor-core dot; the interpreter's dot cannot multiply bf16 (it sees raw
    # bits), so there both are upcast (exact) and only the summation order differs from the GPU
    dot_f32 = interpreting() or not (ld.dtype == x2.dtype and x2.dtype != torch.float32)
    chunk = _chunk(k)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]),)

    _w4a8_act_kernel[grid](
        x2, smooth_inv.to(torch.float32).contiguous(), ld, qx, sx, lora_act, m, k, r, _bucket(m),
        x2.stride(0), qx.stride(0), ld.stride(0), lora_act.stride(0),
        TRIP=k // chunk if interpreting() else 0, HAS_LORA=r > 0, R_PAD=_r_pad(r), DOT_F32=dot_f32,
        SOFT=interpreting(), CHUNK=chunk)
    return qx, sx, lora_act


def fold_row_scale(wscale: torch.Tensor) -> torch.Tensor:
    """``sw[n] = div_rn(8 * max_g wscale[n, g], 448)`` (fp32 [N]): the per-row scale of ``fold=True``
    (``dit_passes.quant.w4a8.fold_row_scale``), in one launch."""
    n, groups = wscale.shape
    ws = wscale if wscale.stride(-1) == 1 else wscale.contiguous()
    sw = torch.empty((n,), dtype=torch.float32, device=ws.device)
    block_n, block_g = 64, 64
    trip = triton.cdiv(groups, block_g)
    _fold_scale_kernel[(triton.cdiv(n, block_n),)](ws, sw, n, groups, ws.stride(0),
                                                    TRIP=trip if interpreting() else 0, BLOCK_N=block_n,
                                                    BLOCK_G=block_g)
    return sw


def w4a8_gemm(qx: torch.Tensor, sx: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
              lora_act: Optional[torch.Tensor] = None, lora_up: Optional[torch.Tensor] = None,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, *,
              fold: bool = False, config: Optional[Dict[str, int]] = None) -> torch.Tensor:
    """[M, N] in ``out_dtype`` from :func:`w4a8_act_quant`'s ``qx`` / ``sx`` / ``lora_act`` and SVDQuant's stored
    qweight uint8 [N, K/2] (even k in the low nibble), wscale [N, K/64], lora_up [N, r], bias [N] or None.
    ``config`` (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` (a multiple of 64 dividing K), ``GROUP_M``, optional
    ``PREFETCH`` (0 / 1: convert the next group's weights during this group's MMAs; BLOCK_K 64), ``num_warps`` /
    ``num_stages``) skips the autotuner; the interpreter always runs one (default
    ``W4A8_INTERPRET_GEMM``)."""
    m, k = qx.shape
    n = qweight.shape[0]
    problems = []
    if qx.dtype != torch.float8_e4m3fn or k % GROUP or k == 0:
        problems.append(f"qx must be float8_e4m3fn [M, K] with K % {GROUP} == 0, got {qx.dtype} {tuple(qx.shape)}")
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, k // 2):
        problems.append(f"qweight must be uint8 [N, {k // 2}], got {qweight.dtype} {tuple(qweight.shape)}")
    if tuple(wscale.shape) != (n, k // GROUP) or not wscale.dtype.is_floating_point:
        problems.append(f"wscale must be float [{n}, {k // GROUP}], got {wscale.dtype} {tuple(wscale.shape)}")
    if tuple(sx.shape) != (m,) or sx.dtype != torch.float32:
        problems.append(f"sx must be fp32 [{m}], got {sx.dtype} {tuple(sx.shape)}")
    r = 0 if lora_act is None else lora_act.shape[1]
    if (lora_act is None) != (lora_up is None):
        problems.append("pass both lora_act and lora_up, or neither")
    elif r and (tuple(lora_act.shape) != (m, r) or lora_act.dtype != torch.float32
                or tuple(lora_up.shape) != (n, r)):
        problems.append(f"lora_act must be fp32 [{m}, r] and lora_up [{n}, r], got {tuple(lora_act.shape)} "
                        f"{lora_act.dtype} and {tuple(lora_up.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        problems.append(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out_dtype not in _ACT_DTYPES:
        problems.append(f"out_dtype must be one of {_ACT_DTYPES}, got {out_dtype}")
    if problems:
        raise ValueError("w4a8_gemm: " + "; ".join(problems))
    dev = _check_device("w4a8_gemm", qx, sx, qweight, wscale, lora_act, lora_up, bias)
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return out
    qw = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    ws = wscale if wscale.stride(-1) == 1 else wscale.contiguous()
    sw = fold_row_scale(wscale) if fold else sx  # unused pointer when FOLD is False
    la = lora_act if r else sx
    lu = (lora_up if lora_up.stride(-1) == 1 else lora_up.contiguous()) if r else sx
    b = bias.contiguous() if bias is not None else sx

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    args = (qx, sx, qw, ws, sw, la, lu, b, out, m, n, k, r, _bucket(m), qx.stride(0), qw.stride(0), ws.stride(0),
            la.stride(0) if r else 0, lu.stride(0) if r else 0, out.stride(0))
    flags = dict(HAS_LORA=r > 0, HAS_BIAS=bias is not None, R_PAD=_r_pad(r), FOLD=bool(fold), SOFT=interpreting(),
                 LORA_IEEE=out_dtype == torch.float32)
    if config is None and not interpreting():
        _w4a8_gemm_tuned[grid](*args, TRIP=0, **flags)
        return out
    cfg = {"PREFETCH": 0, **(config or W4A8_INTERPRET_GEMM)}
    if cfg["BLOCK_K"] % GROUP or k % cfg["BLOCK_K"] or (cfg["PREFETCH"] and cfg["BLOCK_K"] != GROUP):
        raise ValueError(f"w4a8_gemm: BLOCK_K={cfg['BLOCK_K']} must be a multiple of {GROUP} dividing K={k} "
                         f"({GROUP} with PREFETCH)")
    launch = {"num_warps": cfg.pop("num_warps", 4), "num_stages": cfg.pop("num_stages", 1 if interpreting() else 3)}
    # TRIP: the interpreter's compile-time trip count (see _w4a8_act_kernel); 0 on the GPU
    _w4a8_gemm_kernel[grid(cfg)](*args, TRIP=k // cfg["BLOCK_K"] if interpreting() else 0, **flags, **cfg, **launch)
    return out


def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                fold: bool = False) -> torch.Tensor:
    """The SVDQuant linear as W4A8 through both kernels: x [..., K] -> [..., N] in x.dtype. Same tensors as
    ``dit_passes.quant.int4.w4a4_linear_reference``; the numerics of ``dit_passes.quant.w4a8.w4a8_linear_reference``
    with the same ``fold``."""
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] * 2 != x.shape[-1]:
        raise ValueError(f"w4a8_linear: input has K={x.shape[-1]} features but qweight is {tuple(qweight.shape)} "
                         f"(expected [N, {x.shape[-1] // 2}])")
    r = lora_down.shape[0]
    if lora_up.dim() != 2 or tuple(lora_up.shape) != (n, r):
        raise ValueError(f"w4a8_linear: lora_up must have shape [{n}, {r}], got {tuple(lora_up.shape)}")
    qx, sx, lora_act = w4a8_act_quant(x, smooth_inv, lora_down)
    out = w4a8_gemm(qx, sx, qweight, wscale, lora_act if r else None, lora_up if r else None, bias, x.dtype,
                    fold=fold)
    return out.reshape(*x.shape[:-1], n)


def is_supported(x2d: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether these kernels can run this linear: CUDA tensors on sm_89+ (fp8 tensor cores), a float activation
    dtype, K a multiple of 64 (or any device under the Triton interpreter)."""
    if x2d.dtype not in _ACT_DTYPES or x2d.shape[-1] % GROUP or qweight.dtype != torch.uint8:
        return False
    if interpreting():
        return True
    if not (x2d.is_cuda and qweight.is_cuda):
        return False
    return torch.cuda.get_device_capability(x2d.device) >= (8, 9)
