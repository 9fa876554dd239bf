"""The SVDQuant W4A4 linear through the CUTLASS fp8 groupwise GEMM (``w4a4_cutlass.py``).

One call of :func:`w4a4_linear` (x bf16 [..., K], the arguments of ``int4.w4a4_linear_reference``):

1. :func:`fused_act_quant_e4m3` -- ``w4a4_triton.fused_act_quant(..., e4m3=True)``: the same single pass
   over x as the Triton path (smoothing, per-token per-64-group scales, rint/clamp to -8..7, low-rank down
   projection, split-K partial sums), the int4 values written as float8_e4m3fn bytes [M, K] (exact)
   instead of packed nibbles; ascale fp32 [M, K/64] with strides (1, M), the layout the GEMM reads;
2. :func:`weight_e4m3` -- the packed int4 weight [N, K/2] (stored: 0.28x bf16 bytes) unpacked to e4m3
   [N, K] and wscale bf16 [N, K/64] to fp32 group-major, one memory-bound Triton pass per call, or once
   per weight with ``cache_weights=True`` (keeps 1 byte/weight more, and a
   reference to the packed weight, for the process lifetime; :func:`clear_weight_cache`);
3. :func:`lowrank_up_bias` -- ``c = bf16(lora_act @ lora_up.T + bias)`` [M, N] (tf32 dot), one pass;
4. ``w4a4_cutlass.w4a4_gemm_fp8(a, ascale, w, wscale, c)`` -- the epilogue adds c (so c is rounded to
   bf16 once before the final bf16 rounding: the only arithmetic difference from the reference besides
   fp32 summation order).

When this path runs instead of the Triton GEMM (``form``, the timing table, the device)
and with which tile config is decided in one place, ``dit_passes.quant.dispatch``.
Only bf16 activations, K % 64 == 0, N % 16 == 0 on a compute-capability-9 GPU take the CUTLASS path.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import w4a4_cutlass as C
from . import w4a4_triton as T
from .w4a4_autotune import interpreting

_round_to_bf16_rne = T._round_to_bf16_rne  # Triton resolves jit helpers through this module's globals
_int4_to_e4m3_bits = T._int4_to_e4m3_bits
GROUP = 64


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _unpack_weight_kernel(qw_ptr, ws_ptr, w8_ptr, wst_ptr, N, KH, G, s_qn, s_wsn, s_wsg,
                          BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr):
    """packed int4 [N, K/2] -> e4m3 bytes [N, K] (k order); wscale [N, G] -> fp32 storage [G, N]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_b = pid_k * BLOCK_KH + tl.arange(0, BLOCK_KH)
    p = tl.load(qw_ptr + rows[:, None] * s_qn + offs_b[None, :], mask=n_ok[:, None] & (offs_b < KH)[None, :],
                other=0).to(tl.int32)
    lo = _int4_to_e4m3_bits(((p & 0xF) ^ 8) - 8)  # sign-extended nibbles: even k low, odd k high
    hi = _int4_to_e4m3_bits(((p >> 4) ^ 8) - 8)
    e = tl.reshape(tl.join(lo, hi), [BLOCK_N, 2 * BLOCK_KH])
    offs_k = pid_k * (2 * BLOCK_KH) + tl.arange(0, 2 * BLOCK_KH)
    tl.store(w8_ptr + rows[:, None] * (2 * KH) + offs_k[None, :], e, mask=n_ok[:, None] & (offs_k < 2 * KH)[None, :])
    offs_g = pid_k * (BLOCK_KH // 32) + tl.arange(0, BLOCK_KH // 32)
    gm = n_ok[:, None] & (offs_g < G)[None, :]
    s = tl.load(ws_ptr + rows[:, None] * s_wsn + offs_g[None, :] * s_wsg, mask=gm, other=1.0).to(tl.float32)
    tl.store(wst_ptr + offs_g[None, :].to(tl.int64) * N + rows[:, None], s, mask=gm)


@triton.jit
def _lowrank_up_kernel(la_ptr, lu_ptr, b_ptr, c_ptr, M, N, R, s_lam, s_lun, s_cm,
                       HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c [M, N] = round_bf16(lora_act @ lora_up.T + bias), fp32 (tf32 dot unless IEEE)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rm, rn = offs_m.to(tl.int64), offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_LORA:
        offs_r = tl.arange(0, R_PAD)
        r_ok = (offs_r < R)[None, :]
        la = tl.load(la_ptr + rm[:, None] * s_lam + offs_r[None, :], mask=m_ok[:, None] & r_ok, other=0.0)
        lu = tl.load(lu_ptr + rn[:, None] * s_lun + offs_r[None, :], mask=n_ok[:, None] & r_ok, other=0.0)
        if IEEE:
            acc = tl.dot(la, tl.trans(lu.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(la, tl.trans(lu.to(tl.float32)), acc, input_precision="tf32")
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _round_to_bf16_rne(acc).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * s_cm + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------- wrappers


def fused_act_quant_e4m3(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, *,
                         split_k: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a float8_e4m3fn [M, K] (int4 values), ascale fp32 [M, K/64] strides (1, M), lora_act fp32 [M, r])``:
    ``w4a4_triton.fused_act_quant(..., e4m3=True)``, the one activation-quantization pass."""
    return T.fused_act_quant(x, smooth_inv, lora_down, split_k=split_k, e4m3=True)


def unpack_weight_e4m3(qweight: torch.Tensor, wscale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """packed int4 uint8 [N, K/2] + wscale [N, K/64] -> (float8_e4m3fn [N, K], fp32 [N, K/64] strides (1, N))."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"unpack_weight_e4m3: qweight must be uint8 [N, K/2], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, kh = qweight.shape
    if kh % 32 or wscale.shape != (n, kh // 32):
        raise ValueError(f"unpack_weight_e4m3: need K % 64 == 0 and wscale [N, K/64], got qweight "
                         f"{tuple(qweight.shape)}, wscale {tuple(wscale.shape)}")
    dev = T._check_device("unpack_weight_e4m3", qweight, wscale)
    w8 = torch.empty((n, 2 * kh), dtype=torch.float8_e4m3fn, device=dev)
    wst = torch.empty((kh // 32, n), dtype=torch.float32, device=dev)
    if n and kh:
        qw = T._last_contiguous(qweight)
        bn, bkh = (16, 64) if interpreting() else (32, 128)
        _unpack_weight_kernel[(triton.cdiv(n, bn), triton.cdiv(kh, bkh))](
            qw, wscale, w8.view(torch.uint8), wst, n, kh, kh // 32, qw.stride(0), wscale.stride(0),
            wscale.stride(1), BLOCK_N=bn, BLOCK_KH=bkh, num_warps=4)
    return w8, wst.t()


_WEIGHT_CACHE: Dict[tuple, tuple] = {}


def clear_weight_cache() -> None:
    _WEIGHT_CACHE.clear()


def weight_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, cache: bool = False):
    """:func:`unpack_weight_e4m3`, memoised per weight when ``cache`` (the caller's choice: 1 byte per weight more
    held). A hit needs the same storage, shape and version counters; the entry holds the packed weight, so its
    address cannot be reused by another tensor while cached."""
    if not cache:
        return unpack_weight_e4m3(qweight, wscale)
    key = (qweight.data_ptr(), tuple(qweight.shape), qweight.stride(), wscale.data_ptr(), str(qweight.device))
    ver = (qweight._version, wscale._version)
    hit = _WEIGHT_CACHE.get(key)
    if hit is not None and hit[2] == ver:
        return hit[3], hit[4]
    w8, wsc = unpack_weight_e4m3(qweight, wscale)
    _WEIGHT_CACHE[key] = (qweight, wscale, ver, w8, wsc)
    return w8, wsc


def lowrank_up_bias(lora_act: Optional[torch.Tensor], lora_up: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], m: int, n: int, device) -> Optional[torch.Tensor]:
    """bf16 [m, n] = lora_act fp32 [m, r] @ lora_up [n, r].T + bias [n] (either part may be None);
    None when both are."""
    r = 0 if lora_act is None else lora_act.shape[1]
    if r == 0 and bias is None:
        return None
    c = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    if m == 0 or n == 0:
        return c
    la = T._last_contiguous(lora_act) if r else c
    lu = T._last_contiguous(lora_up) if r else c
    b = bias.contiguous() if bias is not None else c
    bm, bn = (16, 32) if interpreting() else (64, 128)
    _lowrank_up_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        la, lu, b, c, m, n, r, la.stride(0) if r else 0, lu.stride(0) if r else 0, c.stride(0),
        HAS_LORA=r > 0, HAS_BIAS=bias is not None, R_PAD=T._r_pad(r), IEEE=interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return c


def w4a4_gemm_fp8_reference(a8, ascale, w8, wscale, c=None) -> torch.Tensor:
    """Any-device torch version of ``w4a4_cutlass.w4a4_gemm_fp8`` (fp32 group sums, bf16 out)."""
    m, k = a8.shape
    n = w8.shape[0]
    dots = torch.einsum("mgk,ngk->mng", a8.float().reshape(m, -1, GROUP), w8.float().reshape(n, -1, GROUP))
    acc = (dots * ascale.float()[:, None, :] * wscale.float()[None, :, :]).sum(-1)
    return (acc if c is None else acc + c.float()).to(torch.bfloat16)


def w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                config: str = "auto", cache_weights: bool = False,
                gemm: Optional[Callable] = None) -> torch.Tensor:
    """The SVDQuant W4A4 linear through the CUTLASS GEMM: x bf16 [..., K] -> bf16 [..., N] (arguments of
    ``int4.w4a4_linear_reference``). ``config``: a tile config of ``w4a4_cutlass.CONFIGS`` or "auto" (its
    heuristic; ``dit_passes.quant.dispatch`` passes the timing table's choice). ``gemm`` replaces
    ``w4a4_gemm_fp8`` (tests: the reference)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"w4a4_linear (CUTLASS): x must be bfloat16 (the compiled epilogue), got {x.dtype}")
    k, n, r = x.shape[-1], qweight.shape[0], lora_down.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] * 2 != k or lora_up.shape != (n, r):
        raise ValueError(f"w4a4_linear (CUTLASS): x has K={k}, qweight is {tuple(qweight.shape)} (expected "
                         f"[N, {k // 2}]), lora_up {tuple(lora_up.shape)} (expected [{n}, {r}])")
    a8, ascale, lora_act = fused_act_quant_e4m3(x, smooth_inv, lora_down)
    w8, wsc = weight_e4m3(qweight, wscale, cache_weights)
    c = lowrank_up_bias(lora_act if r else None, lora_up if r else None, bias, a8.shape[0], n, a8.device)
    if gemm is None:
        out = C.w4a4_gemm_fp8(a8, ascale, w8, wsc, c, config=config)
    else:
        out = gemm(a8, ascale, w8, wsc, c)
    return out.reshape(*x.shape[:-1], n)
