"""The SVDQuant W4A4 linear through the CUTLASS fp8 groupwise GEMM (``w4a4_cutlass.py``), and the
per-shape choice between it and the Triton GEMM (``w4a4_triton.py``).

One call of :func:`w4a4_linear` (x bf16 [..., K], the arguments of ``int4.w4a4_linear_reference``):

1. :func:`fused_act_quant_e4m3` -- one Triton pass over x, the arithmetic of ``w4a4_triton.fused_act_quant``
   (smoothing, per-token per-64-group scales, rint/clamp to -8..7, low-rank down projection, split-K
   partial sums) but the int4 values are written as float8_e4m3fn bytes [M, K] (exact) instead of packed
   nibbles; ascale fp32 [M, K/64] with strides (1, M), the layout the GEMM reads;
2. :func:`weight_e4m3` -- the packed int4 weight [N, K/2] (stored: 0.28x bf16 bytes) unpacked to e4m3
   [N, K] and wscale bf16 [N, K/64] to fp32 group-major, one memory-bound Triton pass per call, or once
   per weight with ``DIT_PASSES_W4A4_CUTLASS_WEIGHT_CACHE=1`` (keeps 1 byte/weight more, and a
   reference to the packed weight, for the process lifetime; :func:`clear_weight_cache`);
3. :func:`lowrank_up_bias` -- ``c = bf16(lora_act @ lora_up.T + bias)`` [M, N] (tf32 dot), one pass;
4. ``w4a4_cutlass.w4a4_gemm_fp8(a, ascale, w, wscale, c)`` -- the epilogue adds c (so c is rounded to
   bf16 once before the final bf16 rounding: the only arithmetic difference from the reference besides
   fp32 summation order).

Backend choice (:func:`use_cutlass`, called by ``dit_passes.quant.ops`` on CUDA):
``DIT_PASSES_W4A4_BACKEND`` = ``triton`` | ``cutlass`` (builds the library if needed) | ``auto`` (default:
CUTLASS only when its library is already built and loads, then per shape from the timing table
``$DIT_PASSES_W4A4_TABLE`` (default ``<cutlass cache>/w4a4_backend_table.json``, written by
``bench/cutlass_w4a4_e2e.py``): the entry of the same (N, K) with the nearest M -- its backend and
CUTLASS tile config; CUTLASS with the default config without one).
Only bf16 activations, K % 64 == 0, N % 16 == 0 on a compute-capability-9 GPU take the CUTLASS path.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

try:  # package import (dit_passes.kernels / kernels) or loaded by file path (bench, tests)
    from . import w4a4_cutlass as C
    from . import w4a4_triton as T
    from .w4a4_autotune import act_quant_configs, interpreting
except ImportError:  # pragma: no cover - loaded as a top-level module by file path
    import importlib.util as _ilu

    def _sibling(name):
        spec = _ilu.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py"))
        mod = _ilu.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    C, T, _A = _sibling("w4a4_cutlass"), _sibling("w4a4_triton"), _sibling("w4a4_autotune")
    act_quant_configs, interpreting = _A.act_quant_configs, _A.interpreting

_round_to_bf16_rne = T._round_to_bf16_rne
GROUP = 64
BACKEND_ENV, TABLE_ENV = "DIT_PASSES_W4A4_BACKEND", "DIT_PASSES_W4A4_TABLE"
WEIGHT_CACHE_ENV = "DIT_PASSES_W4A4_CUTLASS_WEIGHT_CACHE"
BACKENDS = ("auto", "triton", "cutlass")


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _int4_to_e4m3_bits(q):
    """int32 values in [-8, 7] -> their float8_e4m3fn bit patterns (uint8), by integer arithmetic on the
    fp32 bits (exponent rebias 127 -> 7, top 3 mantissa bits), identical in the interpreter."""
    a = tl.abs(q)
    bits = a.to(tl.float32).to(tl.int32, bitcast=True)
    e = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    e = tl.where(a == 0, 0, e) | tl.where(q < 0, 0x80, 0)
    return e.to(tl.uint8)


@triton.autotune(configs=act_quant_configs(), key=["M_BUCKET", "K", "R_PAD", "SPLIT"])
@triton.jit
def _act_quant_e4m3_kernel(x_ptr, si_ptr, ld_ptr, q_ptr, as_ptr, la_ptr,
                           M, K, R, GROUPS_PER_SPLIT, M_BUCKET, SPLIT,
                           s_xm, s_qm, s_asg, s_ldr, s_las, s_lam,
                           STATIC_TRIP: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
                           DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr):
    # w4a4_triton._fused_act_quant_kernel with e4m3 bytes [M, K] out instead of packed nibbles.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_c = tl.arange(0, 64)
    offs_r = tl.arange(0, R_PAD)
    lora = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
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
        y = (y + 12582912.0) - 12582912.0  # rint, half to even
        q = tl.minimum(tl.maximum(y, -8.0), 7.0).to(tl.int32)
        tl.store(q_ptr + rows[:, None] * s_qm + cols[None, :], _int4_to_e4m3_bits(q), mask=mg[:, None])
        tl.store(as_ptr + g * s_asg + rows, scale, mask=mg)
        if HAS_LORA:
            ld = tl.load(ld_ptr + offs_r[:, None] * s_ldr + cols[None, :], mask=((offs_r < R) & g_ok)[:, None],
                         other=0.0)
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
    """One pass over x [..., K]: ``(a float8_e4m3fn [M, K] (int4 values), ascale fp32 [M, K/64] strides
    (1, M), lora_act fp32 [M, r])``; same arithmetic and arguments as ``w4a4_triton.fused_act_quant``."""
    if x.dtype not in T._ACT_DTYPES:
        raise TypeError(f"fused_act_quant_e4m3: x must be one of {T._ACT_DTYPES}, got {x.dtype}")
    k = x.shape[-1] if x.dim() else 0
    if k == 0 or k % GROUP:
        raise ValueError(f"fused_act_quant_e4m3: K = x.shape[-1] must be a positive multiple of {GROUP}, "
                         f"got shape {tuple(x.shape)}")
    if smooth_inv.shape != (k,):
        raise ValueError(f"fused_act_quant_e4m3: smooth_inv must have shape ({k},), got {tuple(smooth_inv.shape)}")
    if lora_down.dim() != 2 or lora_down.shape[1] != k or lora_down.dtype not in T._ACT_DTYPES:
        raise ValueError(f"fused_act_quant_e4m3: lora_down must be a float [rank, {k}] tensor, got "
                         f"{lora_down.dtype} {tuple(lora_down.shape)}")
    dev = T._check_device("fused_act_quant_e4m3", x, smooth_inv, lora_down)
    x2 = T._last_contiguous(x.reshape(-1, k))
    m, ng, r = x2.shape[0], k // GROUP, lora_down.shape[0]
    a8 = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    ascale = torch.empty((ng, m), dtype=torch.float32, device=dev).t()
    if m == 0:
        return a8, ascale, torch.zeros((0, r), dtype=torch.float32, device=dev)
    if split_k is None:  # ~4 programs per multiprocessor with 32-row tiles (as fused_act_quant)
        split_k = -(-4 * T._num_sms(dev) // triton.cdiv(m, 32))
    gps = triton.cdiv(ng, max(1, min(int(split_k), ng)))
    split = triton.cdiv(ng, gps)
    partial = torch.empty((split, m, r), dtype=torch.float32, device=dev)
    si = smooth_inv.to(torch.float32).contiguous()
    ld = T._last_contiguous(lora_down)
    dot_f32 = interpreting() or not (ld.dtype == x2.dtype and x2.dtype != torch.float32)
    q = a8.view(torch.uint8)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), split)

    _act_quant_e4m3_kernel[grid](
        x2, si, ld, q, ascale, partial, m, k, r, gps, T._bucket(m), split,
        x2.stride(0), q.stride(0), ascale.stride(1), ld.stride(0), partial.stride(0), partial.stride(1),
        STATIC_TRIP=gps if interpreting() else 0, HAS_LORA=r > 0, R_PAD=T._r_pad(r), DOT_F32=dot_f32)
    return a8, ascale, (partial[0] if split == 1 else partial.sum(0))


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


def weight_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, cache: Optional[bool] = None):
    """:func:`unpack_weight_e4m3`, memoised per weight when ``cache`` (default: ``$DIT_PASSES_W4A4_CUTLASS_
    WEIGHT_CACHE`` = 1). A hit needs the same storage, shape and version counters; the entry holds the
    packed weight, so its address cannot be reused by another tensor while cached."""
    if cache is None:
        cache = os.environ.get(WEIGHT_CACHE_ENV, "0") not in ("", "0")
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
                config: str = "auto", cache_weights: Optional[bool] = None,
                gemm: Optional[Callable] = None) -> torch.Tensor:
    """The SVDQuant W4A4 linear through the CUTLASS GEMM: x bf16 [..., K] -> bf16 [..., N] (arguments of
    ``int4.w4a4_linear_reference``). ``gemm`` replaces ``w4a4_gemm_fp8`` (tests: the reference)."""
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
        if config == "auto" and not os.environ.get("DIT_PASSES_CUTLASS_CONFIG") and (a8.shape[0], n, k) not in C._AUTO:
            e = table_entry(a8.shape[0], n, k)
            config = e[2] if e is not None and e[2] else "auto"
        out = C.w4a4_gemm_fp8(a8, ascale, w8, wsc, c, config=config)
    else:
        out = gemm(a8, ascale, w8, wsc, c)
    return out.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------- backend choice


def backend_setting() -> str:
    s = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if s not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={s!r}: expected one of {BACKENDS}")
    return s


def table_path() -> str:
    return os.environ.get(TABLE_ENV) or os.path.join(C._cache_root(), "w4a4_backend_table.json")


_TABLES: Dict[tuple, Dict[tuple, list]] = {}


def _table(path: str) -> Dict[tuple, list]:
    try:
        stamp = (path, os.stat(path).st_mtime_ns)
    except OSError:
        return {}
    if stamp not in _TABLES:
        out: Dict[tuple, list] = {}
        try:
            for e in json.load(open(path)).get("entries", []):
                if e.get("backend") in ("triton", "cutlass"):
                    cfg = e.get("config") if e.get("config") in C.CONFIGS else None
                    out.setdefault((int(e["N"]), int(e["K"])), []).append((int(e["M"]), e["backend"], cfg))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            warnings.warn(f"ignoring the W4A4 backend table {path}: {err}")
        _TABLES[stamp] = out
    return _TABLES[stamp]


def table_entry(m: int, n: int, k: int, path: Optional[str] = None) -> Optional[tuple]:
    """The timing table's ``(M, backend, cutlass config or None)`` for this (N, K) with the nearest M
    (log scale), or None."""
    rows = _table(path or table_path()).get((int(n), int(k)))
    if not rows:
        return None
    return min(rows, key=lambda e: abs(math.log(max(e[0], 1)) - math.log(max(m, 1))))


def table_choice(m: int, n: int, k: int, path: Optional[str] = None) -> Optional[str]:
    """The timing table's backend for this shape (:func:`table_entry`), or None."""
    e = table_entry(m, n, k, path)
    return None if e is None else e[1]


def write_table(entries, path: Optional[str] = None, **meta) -> str:
    """Write ``{"entries": [{"M", "N", "K", "backend", ...timings}], **meta}`` (the bench does)."""
    path = path or table_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**meta, "entries": list(entries)}, f, indent=1)
    return path


def cutlass_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Shape, dtype and device the CUTLASS path handles (not whether its library is present)."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and qweight.is_cuda and qweight.dtype == torch.uint8
            and qweight.dim() == 2 and x.shape[-1] % GROUP == 0 and x.shape[-1] == 2 * qweight.shape[1]
            and qweight.shape[0] % 16 == 0 and torch.cuda.get_device_capability(x.device)[0] == 9)


_READY: Dict[bool, bool] = {}
_WARNED = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg)


def cutlass_ready(build_if_needed: bool) -> bool:
    """``w4a4_cutlass.is_available``, memoised here (a negative answer too, until :func:`reset`)."""
    if build_if_needed not in _READY:
        _READY[build_if_needed] = C.is_available(build_if_needed=build_if_needed)
    return _READY[build_if_needed]


def reset() -> None:
    """Forget the memoised library availability and tables (after a build, or a new table)."""
    _READY.clear()
    _TABLES.clear()
    C._AVAILABLE = None


def use_cutlass(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``dit_passes::svdq_w4a4_linear`` should run this call through :func:`w4a4_linear`."""
    setting = backend_setting()
    if setting == "triton":
        return False
    if not cutlass_supported(x, qweight):
        if setting == "cutlass" and x.is_cuda:
            _warn_once(f"{BACKEND_ENV}=cutlass: this linear (x {x.dtype} K={x.shape[-1]}, N={qweight.shape[0]}) "
                       "needs bf16, K % 64 == 0, N % 16 == 0 on an sm_90 GPU; it runs on Triton")
        return False
    if not cutlass_ready(build_if_needed=setting == "cutlass"):
        if setting == "cutlass":
            _warn_once(f"{BACKEND_ENV}=cutlass but the CUTLASS library is unavailable (headers: `{C.PIP_HINT}`, "
                       "nvcc); W4A4 runs on Triton")
        return False
    m = x.numel() // max(x.shape[-1], 1)
    return setting == "cutlass" or table_choice(m, qweight.shape[0], x.shape[-1]) in (None, "cutlass")
