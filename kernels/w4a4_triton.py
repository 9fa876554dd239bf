"""W4A4 (SVDQuant) Triton kernels: fused activation quantization and the int4 x int4 GEMM.

The arithmetic is the one of ``dit_passes.quant.int4`` (the executable specification), step by step:

* ``x_s = x.float() * smooth_inv``; per token m and K-group g of 64: ``ascale = div_rn(amax|x_s|, 7)``
  (correctly rounded), a zero scale becomes 1; ``q = clamp(rint(div_rn(x_s, ascale)), -8, 7)``,
  round half to even;
* packing: int4 two's complement, ``byte[i] = (q[2i] & 0xF) | ((q[2i+1] & 0xF) << 4)``;
* ``lora_act = x_s.to(x.dtype) @ lora_down.T`` (fp32 accumulation);
* ``out = sum_g (ascale[:, g] * wscale[:, g]) * float(int32 dot_g) + lora_act @ lora_up.T + bias``.

Public functions: :func:`fused_act_quant`, :func:`w4a4_gemm`, :func:`w4a4_linear`, :func:`is_supported`
(the contract ``dit_passes.quant.ops`` calls). :func:`w4a4_gemm_dot_ceiling` is a benchmark diagnostic.

Design notes (Hopper, sm_90, which has no int4 MMA):

* the GEMM loads one K-group per iteration: 32 packed bytes per row of A and B, unpacks them in
  registers into the low nibbles (even k) and the high nibbles (odd k), sign-extended with
  ``(b << 4) >> 4`` / ``b >> 4`` on int8, and issues two K=32 int8 ``tl.dot`` (wgmma) into one int32
  group accumulator. Splitting by nibble instead of interleaving back to k order is exact (a dot is
  a sum, and A and B are permuted alike inside the group) and needs no register shuffles;
* B is [N, K/2] with K contiguous, so ``tl.trans`` of its tile is the K-major operand int8 wgmma needs;
* the group's int32 result becomes fp32 by an exact bit trick (|d| <= 64*64 < 2**22:
  ``bitcast(d + 0x4B400000) - 12582912.0``: one integer and one float add instead of the slower I2F
  conversion), then one multiply (the scale product) and one fma into the fp32 accumulator;
* ``mma="fp8"`` is the alternative: the int4 values become fp8 e4m3 (exact for -8..7) and the dot
  accumulates in fp32 directly, trading the per-output conversion for a per-operand one;
* ascale is written K/64-major (a [M, K/64] view with strides (1, M)) so that the GEMM's per-group
  scale loads are contiguous;
* the low-rank up projection (a K=r tensor-core dot) initialises the fp32 accumulator before the K loop
  instead of running after it: the same fusion without a second accumulator's registers; bias is added
  in the epilogue;
* rows/columns past M/N are clamped (``% M``) for the loads, so the main loop has no masks, and only
  the store is masked;
* the activation pass is memory-bound: its grid also splits K (``split_k``) so that thousands of
  programs stream x; the per-split low-rank partial sums [split, M, r] are added by one ``sum(0)``
  (deterministic, no atomics).

Rounding: the rint is done as ``(y + 1.5*2**23) - 1.5*2**23`` (round half to even in fp32, exact for
|y| < 2**22; here |y| <= 7), which runs identically in the CPU interpreter, where libdevice is absent.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .w4a4_autotune import act_quant_configs, gemm_configs, interpreting

GROUP = 64
_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MMA_MODES = {"int8": 0, "fp8": 1}


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _round_to_bf16_rne(v):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32 (finite inputs)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int4_to_e4m3_bits(q):
    """int32 values in [-8, 7] -> their float8_e4m3fn bit patterns (uint8), by integer arithmetic on the
    fp32 bits (exponent rebias 127 -> 7, top 3 mantissa bits), identical in the interpreter."""
    a = tl.abs(q)
    bits = a.to(tl.float32).to(tl.int32, bitcast=True)
    e = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    e = tl.where(a == 0, 0, e) | tl.where(q < 0, 0x80, 0)
    return e.to(tl.uint8)


@triton.autotune(configs=act_quant_configs(), key=["M_BUCKET", "K", "R_PAD", "SPLIT", "E4M3"])
@triton.jit
def _fused_act_quant_kernel(x_ptr, si_ptr, ld_ptr, q_ptr, as_ptr, la_ptr,
                            M, K, R, GROUPS_PER_SPLIT, M_BUCKET, SPLIT,
                            s_xm, s_qm, s_asm, s_asg, s_ldr, s_las, s_lam,
                            STATIC_TRIP: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
                            DOT_F32: tl.constexpr, E4M3: tl.constexpr,
                            BLOCK_M: tl.constexpr):
    # E4M3 (the CUTLASS GEMM's input): the int4 values go out as float8_e4m3fn bytes [M, K] (exact), else
    # packed two per byte [M, K/2] (the Triton GEMM's input). Everything else is the same pass.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_c = tl.arange(0, 64)
    offs_b = tl.arange(0, 32)
    offs_r = tl.arange(0, R_PAD)
    lora = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    # Fixed trip count, the last split's surplus groups masked off. STATIC_TRIP (interpreter only) makes
    # it a compile-time constant: Triton 3.6's interpreter cannot loop to a runtime bound under
    # NumPy >= 2.3 (its int() of a 1-element array fails). On the GPU it stays a runtime bound, so one
    # binary serves every K.
    # (No assignment of the bound: the interpreter turns every assigned value into a tensor.)
    for i in range(0, STATIC_TRIP if STATIC_TRIP > 0 else GROUPS_PER_SPLIT):
        g = pid_k * GROUPS_PER_SPLIT + i
        g_ok = g < K // 64
        mg = m_mask & g_ok
        cols = g * 64 + offs_c
        x = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=mg[:, None], other=0.0)
        xs = x.to(tl.float32) * tl.load(si_ptr + cols, mask=(offs_c < 64) & g_ok, other=0.0)[None, :]
        scale = tl.math.div_rn(tl.max(tl.abs(xs), axis=1), 7.0)
        scale = tl.where(scale == 0.0, 1.0, scale)
        y = tl.math.div_rn(xs, scale[:, None])
        y = (y + 12582912.0) - 12582912.0  # rint, half to even (see module docstring)
        q = tl.minimum(tl.maximum(y, -8.0), 7.0).to(tl.int32)
        if E4M3:
            tl.store(q_ptr + rows[:, None] * s_qm + cols[None, :], _int4_to_e4m3_bits(q), mask=mg[:, None])
        else:
            q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_M, 32, 2]))
            packed = ((q_even & 0xF) | ((q_odd & 0xF) << 4)).to(tl.uint8)
            tl.store(q_ptr + rows[:, None] * s_qm + (g * 32 + offs_b)[None, :], packed, mask=mg[:, None])
        tl.store(as_ptr + rows * s_asm + g * s_asg, scale, mask=mg)
        if HAS_LORA:
            ld = tl.load(ld_ptr + offs_r[:, None] * s_ldr + cols[None, :], mask=((offs_r < R) & g_ok)[:, None],
                         other=0.0)
            # The spec's "x_s in the activation dtype". bf16 is rounded to nearest even explicitly, as an
            # fp32 value: the interpreter's own fp32 -> bf16 cast truncates; on the GPU the later .to()
            # of that value is exact.
            if x_ptr.dtype.element_ty == tl.bfloat16:
                xa32 = _round_to_bf16_rne(xs)
            else:
                xa32 = xs.to(x_ptr.dtype.element_ty).to(tl.float32)
            if DOT_F32:
                lora = tl.dot(xa32, tl.trans(ld.to(tl.float32)), lora, input_precision="ieee")
            else:
                lora = tl.dot(xa32.to(x_ptr.dtype.element_ty), tl.trans(ld), lora)
    if HAS_LORA:
        la = la_ptr + pid_k * s_las + rows[:, None] * s_lam + offs_r[None, :]
        tl.store(la, lora, mask=m_mask[:, None] & (offs_r < R)[None, :])


@triton.jit
def _small_int_to_f32(d):
    """Exact int32 -> fp32 for |d| < 2**22: reinterpret d + bits(1.5*2**23), then subtract 1.5*2**23."""
    return (d + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _nibbles(packed_u8, MMA: tl.constexpr):
    """uint8 tile -> (low nibbles, high nibbles) as sign-extended int8 (MMA 0) or fp8 e4m3 (MMA 1)."""
    b = packed_u8.to(tl.int8, bitcast=True)
    lo = (b << 4).to(tl.int8) >> 4
    hi = b >> 4
    if MMA == 1:
        lo = lo.to(tl.float16).to(tl.float8e4nv)
        hi = hi.to(tl.float16).to(tl.float8e4nv)
    return lo, hi


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile) in grouped order: GROUP_M row tiles share each column sweep, so the
    weight tiles they read stay in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.autotune(configs=gemm_configs(),
                 key=["M_BUCKET", "N", "K", "R_PAD", "HAS_LORA", "HAS_BIAS", "MMA", "GROUP_SCALES"])
@triton.jit
def _w4a4_gemm_kernel(qx_ptr, as_ptr, qw_ptr, ws_ptr, la_ptr, lu_ptr, bias_ptr, out_ptr,
                      M, N, K, R, M_BUCKET,
                      s_qxm, s_asm, s_asg, s_qwn, s_wsn, s_wsg, s_lam, s_lun, s_om,
                      STATIC_TRIP: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr,
                      LORA_IEEE: tl.constexpr, MMA: tl.constexpr, GROUP_SCALES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # clamped rows/cols: unmasked loads in the main loop
    rn = (offs_n % N).to(tl.int64)
    offs_b = tl.arange(0, 32)
    a_ptrs = qx_ptr + rm[:, None] * s_qxm + offs_b[None, :]
    b_ptrs = qw_ptr + rn[:, None] * s_qwn + offs_b[None, :]
    as_ptrs = as_ptr + rm * s_asm
    ws_ptrs = ws_ptr + rn * s_wsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_LORA:
        # The low-rank product initialises the accumulator (rather than being added after the K loop):
        # a separate epilogue accumulator would cost a second [BLOCK_M, BLOCK_N] of registers (measured
        # on sm_90 SASS: 191 -> 249 registers for 64x128, spills for 128x128). Only the fp32 summation
        # order differs from the reference.
        offs_r = tl.arange(0, R_PAD)
        r_mask = (offs_r < R)[None, :]
        la = tl.load(la_ptr + rm[:, None] * s_lam + offs_r[None, :], mask=r_mask, other=0.0)
        lu = tl.load(lu_ptr + rn[:, None] * s_lun + offs_r[None, :], mask=r_mask, other=0.0).to(tl.float32)
        if LORA_IEEE:
            acc = tl.dot(la, tl.trans(lu), acc, input_precision="ieee")
        else:
            acc = tl.dot(la, tl.trans(lu), acc, input_precision="tf32")
    acc_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)  # only used by the GROUP_SCALES=False diagnostic
    for g in range(0, STATIC_TRIP if STATIC_TRIP > 0 else K // 64):  # STATIC_TRIP: see _fused_act_quant_kernel
        a_lo, a_hi = _nibbles(tl.load(a_ptrs), MMA)
        b_lo, b_hi = _nibbles(tl.load(b_ptrs), MMA)
        if GROUP_SCALES:
            if MMA == 1:
                d = tl.dot(a_lo, tl.trans(b_lo))
                d = tl.dot(a_hi, tl.trans(b_hi), d)
            else:
                d = tl.dot(a_lo, tl.trans(b_lo), out_dtype=tl.int32)
                d = _small_int_to_f32(tl.dot(a_hi, tl.trans(b_hi), d, out_dtype=tl.int32))
            sa = tl.load(as_ptrs + g * s_asg)
            sw = tl.load(ws_ptrs + g * s_wsg).to(tl.float32)
            acc = acc + (sa[:, None] * sw[None, :]) * d
        else:
            acc_i = tl.dot(a_lo, tl.trans(b_lo), acc_i, out_dtype=tl.int32)
            acc_i = tl.dot(a_hi, tl.trans(b_hi), acc_i, out_dtype=tl.int32)
        a_ptrs += 32
        b_ptrs += 32
    if not GROUP_SCALES:
        acc += acc_i.to(tl.float32)

    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ----------------------------------------------------------------------------------------- wrappers


def _bucket(m: int) -> int:
    """Autotune key for M: the next power of two (so every token count does not re-tune)."""
    return max(16, triton.next_power_of_2(max(m, 1)))


def _r_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(max(r, 1)))  # tl.dot needs every dimension >= 16


def _check_device(name: str, *tensors: Optional[torch.Tensor],
                  reference: str = "in dit_passes.quant.int4") -> torch.device:
    dev = tensors[0].device
    for t in tensors:
        if t is not None and t.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the Triton kernels need CUDA tensors (got {dev}); on CPU use the reference "
                         f"{reference} or set TRITON_INTERPRET=1 (slow, for tests)")
    return dev


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_sms(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 4


def fused_act_quant(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, *,
                    split_k: Optional[int] = None, e4m3: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over x: smoothing, per-token per-group int4 quantization, packing, low-rank down projection.

    x [..., K] (fp32/bf16/fp16, K % 64 == 0), smooth_inv [K] (fp32), lora_down [r, K] (r may be 0).
    Returns ``(qx_packed uint8 [M, K/2], ascale fp32 [M, K/64], lora_act fp32 [M, r])`` with
    M = prod(x.shape[:-1]); with ``e4m3=True`` the first is ``float8_e4m3fn [M, K]`` holding the int4 values
    (exact), the CUTLASS GEMM's operand. ``ascale`` is a view with strides (1, M) (K/64-major storage, for
    coalesced GEMM loads); ``.contiguous()`` it if row-major storage is needed. ``split_k`` (default: chosen
    from M and the multiprocessor count) splits the K-groups over programs; it changes only the summation
    order of ``lora_act``.
    """
    name = "fused_act_quant_e4m3" if e4m3 else "fused_act_quant"
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"{name}: x must be one of {_ACT_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % GROUP != 0 or x.shape[-1] == 0:
        raise ValueError(f"{name}: K = x.shape[-1] must be a positive multiple of {GROUP}, got shape "
                         f"{tuple(x.shape)}; pad the input features or keep this linear unquantized")
    k = x.shape[-1]
    if smooth_inv.shape != (k,):
        raise ValueError(f"{name}: smooth_inv must have shape ({k},), got {tuple(smooth_inv.shape)}")
    if lora_down.dim() != 2 or lora_down.shape[1] != k or lora_down.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: lora_down must be a float [rank, {k}] tensor, got "
                         f"{lora_down.dtype} {tuple(lora_down.shape)}")
    dev = _check_device(name, x, smooth_inv, lora_down)
    x2 = _last_contiguous(x.reshape(-1, k))
    m, ng, r = x2.shape[0], k // GROUP, lora_down.shape[0]
    if e4m3:
        qx = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    else:
        qx = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    ascale = torch.empty((ng, m), dtype=torch.float32, device=dev).t()
    if m == 0:
        return qx, ascale, torch.zeros((0, r), dtype=torch.float32, device=dev)
    if split_k is None:  # aim at ~4 programs per multiprocessor, assuming 32-row tiles
        split_k = -(-4 * _num_sms(dev) // triton.cdiv(m, 32))
    split = max(1, min(int(split_k), ng))
    gps = triton.cdiv(ng, split)
    split = triton.cdiv(ng, gps)  # no empty splits
    partial = torch.empty((split, m, r), dtype=torch.float32, device=dev)
    si = smooth_inv.to(torch.float32).contiguous()
    ld = _last_contiguous(lora_down)
    # 16-bit operands use the 16-bit tensor-core dot; the interpreter's dot cannot multiply bf16 (it sees
    # raw bits), so there both are upcast (exact) and only the summation order differs from the GPU.
    dot_f32 = interpreting() or not (ld.dtype == x2.dtype and x2.dtype != torch.float32)
    q = qx.view(torch.uint8)  # the kernel stores bytes (e4m3 bit patterns or packed nibbles)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), split)

    _fused_act_quant_kernel[grid](
        x2, si, ld, q, ascale, partial, m, k, r, gps, _bucket(m), split,
        x2.stride(0), q.stride(0), ascale.stride(0), ascale.stride(1), ld.stride(0),
        partial.stride(0), partial.stride(1),
        STATIC_TRIP=gps if interpreting() else 0, HAS_LORA=r > 0, R_PAD=_r_pad(r), DOT_F32=dot_f32, E4M3=e4m3)
    lora_act = partial[0] if split == 1 else partial.sum(0)
    return qx, ascale, lora_act


def _check_gemm_args(qx_packed, ascale, qw_packed, wscale, lora_act, lora_up, bias, out_dtype):
    problems = []
    if qx_packed.dtype != torch.uint8 or qx_packed.dim() != 2:
        problems.append(f"qx_packed must be uint8 [M, K/2], got {qx_packed.dtype} {tuple(qx_packed.shape)}")
    if qw_packed.dtype != torch.uint8 or qw_packed.dim() != 2:
        problems.append(f"qw_packed must be uint8 [N, K/2], got {qw_packed.dtype} {tuple(qw_packed.shape)}")
    if problems:
        raise ValueError("w4a4_gemm: " + "; ".join(problems))
    m, kh = qx_packed.shape
    n = qw_packed.shape[0]
    k = kh * 2
    if k == 0 or k % GROUP:
        problems.append(f"K = 2 * qx_packed.shape[1] = {k} must be a positive multiple of {GROUP}")
    if qw_packed.shape[1] != kh:
        problems.append(f"qx_packed packs K/2={kh} but qw_packed packs {qw_packed.shape[1]}")
    ng = k // GROUP
    if ascale.shape != (m, ng) or ascale.dtype != torch.float32:
        problems.append(f"ascale must be fp32 [{m}, {ng}], got {ascale.dtype} {tuple(ascale.shape)}")
    if wscale.shape != (n, ng) or not wscale.dtype.is_floating_point:
        problems.append(f"wscale must be float [{n}, {ng}], got {wscale.dtype} {tuple(wscale.shape)}")
    if (lora_act is None) != (lora_up is None):
        problems.append("pass both lora_act and lora_up, or neither")
    elif lora_act is not None:
        if lora_act.dim() != 2 or lora_act.shape[0] != m or lora_act.dtype != torch.float32:
            problems.append(f"lora_act must be fp32 [{m}, r], got {lora_act.dtype} {tuple(lora_act.shape)}")
        elif lora_up.shape != (n, lora_act.shape[1]) or not lora_up.dtype.is_floating_point:
            problems.append(f"lora_up must be float [{n}, {lora_act.shape[1]}], got {tuple(lora_up.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.dtype.is_floating_point):
        problems.append(f"bias must be float [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if out_dtype not in _ACT_DTYPES:
        problems.append(f"out_dtype must be one of {_ACT_DTYPES}, got {out_dtype}")
    if problems:
        raise ValueError("w4a4_gemm: " + "; ".join(problems))
    return m, n, k


def _launch_gemm(qx_packed, ascale, qw_packed, wscale, lora_act, lora_up, bias, out_dtype, mma, group_scales):
    if mma not in _MMA_MODES:
        raise ValueError(f"w4a4_gemm: mma must be one of {sorted(_MMA_MODES)}, got {mma!r}")
    m, n, k = _check_gemm_args(qx_packed, ascale, qw_packed, wscale, lora_act, lora_up, bias, out_dtype)
    dev = _check_device("w4a4_gemm", qx_packed, ascale, qw_packed, wscale, lora_act, lora_up, bias)
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0 or n == 0:
        return out
    r = 0 if lora_act is None else lora_act.shape[1]
    qx, qw = _last_contiguous(qx_packed), _last_contiguous(qw_packed)
    la = _last_contiguous(lora_act) if r else qx  # unused pointer when HAS_LORA is False
    lu = _last_contiguous(lora_up) if r else qx
    b = bias.contiguous() if bias is not None else qx

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w4a4_gemm_kernel[grid](
        qx, ascale, qw, wscale, la, lu, b, out, m, n, k, r, _bucket(m),
        qx.stride(0), ascale.stride(0), ascale.stride(1), qw.stride(0), wscale.stride(0), wscale.stride(1),
        la.stride(0) if r else 0, lu.stride(0) if r else 0, out.stride(0),
        STATIC_TRIP=k // GROUP if interpreting() else 0, HAS_LORA=r > 0, HAS_BIAS=bias is not None,
        R_PAD=_r_pad(r), LORA_IEEE=out_dtype == torch.float32,
        MMA=_MMA_MODES[mma], GROUP_SCALES=group_scales)
    return out


def w4a4_gemm(qx_packed: torch.Tensor, ascale: torch.Tensor, qw_packed: torch.Tensor, wscale: torch.Tensor,
              lora_act: Optional[torch.Tensor] = None, lora_up: Optional[torch.Tensor] = None,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32, *,
              mma: str = "int8") -> torch.Tensor:
    """W4A4 GEMM with the low-rank up projection and bias fused in: [M, N] in ``out_dtype``.

    qx_packed uint8 [M, K/2], ascale fp32 [M, K/64] (any strides), qw_packed uint8 [N, K/2], wscale
    [N, K/64] (bf16), lora_act fp32 [M, r] and lora_up [N, r] (both or neither), bias [N] or None.
    ``mma``: "int8" (int8 tensor cores, int32 group sums) or "fp8" (e4m3 operands, fp32 group sums);
    both are exact for int4 operands. The low-rank product runs in full fp32 when ``out_dtype`` is fp32
    and in tf32 otherwise (its error then stays below the bf16/fp16 output rounding).
    """
    return _launch_gemm(qx_packed, ascale, qw_packed, wscale, lora_act, lora_up, bias, out_dtype, mma, True)


def w4a4_gemm_dot_ceiling(qx_packed: torch.Tensor, ascale: torch.Tensor, qw_packed: torch.Tensor,
                          wscale: torch.Tensor, mma: str = "int8") -> torch.Tensor:
    """Benchmark diagnostic, NOT a W4A4 GEMM: the same loads, unpacking and int8 dots with the per-group
    scales left out (one int32 accumulator over all of K, fp32 output = the exact sum of the group dots).
    Its time is the ceiling the real kernel could reach if the group epilogue were free."""
    if mma != "int8":
        raise ValueError("w4a4_gemm_dot_ceiling: only mma='int8' has an integer accumulator")
    return _launch_gemm(qx_packed, ascale, qw_packed, wscale, None, None, None, torch.float32, mma, False)


def w4a4_linear(x: torch.Tensor, qw_packed: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                mma: str = "int8") -> torch.Tensor:
    """The whole SVDQuant W4A4 linear through both kernels: x [..., K] -> [..., N] in x.dtype.

    Same arguments as ``dit_passes.quant.int4.w4a4_linear_reference``.
    """
    n = qw_packed.shape[0]
    if qw_packed.dim() != 2 or qw_packed.shape[1] * 2 != x.shape[-1]:
        raise ValueError(f"w4a4_linear: input has K={x.shape[-1]} features but qw_packed is "
                         f"{tuple(qw_packed.shape)} (expected [N, {x.shape[-1] // 2}])")
    if lora_up.dim() != 2 or lora_up.shape != (n, lora_down.shape[0]):
        raise ValueError(f"w4a4_linear: lora_up must have shape [{n}, {lora_down.shape[0]}], "
                         f"got {tuple(lora_up.shape)}")
    qx, ascale, lora_act = fused_act_quant(x, smooth_inv, lora_down)
    r = lora_down.shape[0]
    out = w4a4_gemm(qx, ascale, qw_packed, wscale, lora_act if r else None, lora_up if r else None, bias,
                    x.dtype, mma=mma)
    return out.reshape(*x.shape[:-1], n)


def is_supported(x2d: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether these kernels can run this linear: CUDA tensors on sm_80+ (int8 tensor cores), a float
    activation dtype, K a multiple of 64 (or any device under the Triton interpreter)."""
    if x2d.dtype not in _ACT_DTYPES or x2d.shape[-1] % GROUP or qweight.dtype != torch.uint8:
        return False
    if interpreting():
        return True
    if not (x2d.is_cuda and qweight.is_cuda):
        return False
    return torch.cuda.get_device_capability(x2d.device) >= (8, 0)
