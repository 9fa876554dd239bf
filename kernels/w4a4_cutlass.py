"""W4A4 (SVDQuant) GEMM on Hopper through CUTLASS's FP8 groupwise-scaled GEMM (``w4a4_cutlass.cu``).

Arithmetic (G = K / 64 groups)::

    out[m, n] = bf16( sum_g ascale[m, g] * wscale[n, g] * dot_g(a[m, 64g:64g+64], w[n, 64g:64g+64]) + c[m, n] )

* ``a`` [M, K] and ``w`` [N, K] are ``torch.float8_e4m3fn``, row-major (K contiguous), holding the int4
  values -8..7 (exact in e4m3); a group's dot is an integer, |d| <= 4096, exact in fp32 accumulation.
* ``ascale`` fp32 [M, G] with strides (1, M): M-major ("MN-major" in CUTLASS), element (m, g) at
  ``ascale_storage[g * M + m]`` -- the layout the activation-quant kernel writes.
* ``wscale`` fp32 [N, G] with strides (1, N): N-major (use :func:`group_major` once at load time).
* ``c`` optional bf16 [M, N] row-major (low-rank branch + bias), added by the epilogue (beta = 1).
* M >= 1 arbitrary, N % 16 == 0, K % 64 == 0; a, w, c must be 16-byte aligned.

Why fp8: Hopper's wgmma has no int4 MMA, and CUTLASS's groupwise-scaled Hopper mainloop
(``KernelTmaWarpSpecialized*FP8Blockwise``) exists only for fp8 inputs: it promotes each K-group's fp32
partial sum into the accumulator with its two scales (FFMA). int4 values are exact in e4m3 and a group's
dot is exact in fp32, so this is the W4A4 arithmetic up to fp32 rounding of the scaled sums.
K-group 64 needs a one-header relaxation of CUTLASS 4.2.0 (its mainloop asserts a K granularity multiple
of 128): :func:`build` puts a patched copy of that header first on the include path (see the .cu).

Public API: :func:`is_available` (never raises), :func:`build`, :func:`built_library`, :func:`configs`,
:func:`w4a4_gemm_fp8`, :func:`group_major`, :func:`find_cutlass_include`, :func:`find_nvcc`,
:func:`resource_usage`. ``w4a4_cutlass_linear.py`` builds the whole SVDQuant linear on top.

The build's environment is ``cutlass_build.py``'s. Which config runs a shape is the caller's ``config`` argument
(``dit_passes.quant.dispatch.cutlass_config``: a forced config, the timing table's, or "auto":
:func:`set_auto_config` entries, else a rule on the tile count).
"""
from __future__ import annotations

import ctypes
import os
import re
from typing import Dict, List, Optional

import torch

from . import cutlass_build
from .cutlass_build import CutlassUnavailable, PIP_HINT, cutlass_version, find_cutlass_include, find_nvcc  # noqa: F401

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "w4a4_cutlass.cu")
CONFIGS = ["coop_128x128", "pingpong_64x128", "coop_128x128_c2x1"]
GROUP_K = 64
ABI_VERSION = 2

_MAINLOOP = "cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp"
# (old, new, expected count) text replacements making the patched header.
_PATCH = [
    ("#pragma once", "#pragma once\n#define W4A4_CUTLASS_PATCHED_SM90_BLOCKWISE 1", 1),
    ('  static_assert(ScalePromotionInterval % 4 == 0, "ScalePromotionInterval must be a multiple of 4.");',
     "  // [w4a4 patch] K-group 64 (interval 2) allowed; the fast path is keyed on interval == k-blocks per tile\n"
     "  static constexpr int W4A4KBlocksPerTile = size<2>(TileShape{}) / tile_size<2>(TiledMma{});\n"
     '  static_assert(ScalePromotionInterval % 2 == 0, "[w4a4 patch] ScalePromotionInterval must be a multiple of 2.");',
     1),
    ("ScalePromotionInterval != 4", "ScalePromotionInterval != W4A4KBlocksPerTile", 5),
]

ERROR_NAMES = dict(enumerate(("ok", "null device pointer", "bad problem shape", "misaligned pointer",
                               "device is not sm_90", "can_implement failed", "workspace too small",
                               "initialize failed", "run failed", "CUDA error", "C++ exception",
                               "not compiled for sm_90a")))

LIBRARY = cutlass_build.CutlassLibrary(name="w4a4_cutlass", source=SOURCE, configs=tuple(CONFIGS),
                                       config_macro="W4A4_CONFIG_INDEX", patches=((_MAINLOOP, tuple(_PATCH)),))
_LIB = None
_LIB_PATH: Optional[str] = None
_AVAILABLE: Optional[bool] = None


def _patched_header(include_dir: str) -> str:
    return cutlass_build.patched_header(include_dir, _MAINLOOP, tuple(_PATCH))


def built_library() -> Optional[str]:
    """The cached library for this source / header / flags (see :func:`build`) or None; never compiles."""
    return cutlass_build.built_library(LIBRARY)


def build(verbose: bool = False, force: bool = False, jobs: Optional[int] = None) -> str:
    """Compile ``w4a4_cutlass.cu`` (cached; ``cutlass_build.build``) and return the path of the shared library:
    one nvcc per config (``-DW4A4_CONFIG_INDEX=i``), one link, a C-ABI library (static cudart, no torch)."""
    return cutlass_build.build(LIBRARY, verbose, force, jobs)


def _kernel_config(mangled: str) -> str:
    # the device_kernel's mangled name carries the schedule and the mainloop's <Stages, ClusterShape>
    if "Pingpong" in mangled:
        return "pingpong_64x128"
    m = re.search(r"BlockwiseFP8ILi\d+E.*?1CILi(\d+)E", mangled)
    return "coop_128x128_c2x1" if (m and m.group(1) == "2") else "coop_128x128"


def resource_usage(so_path: Optional[str] = None) -> Dict[str, Dict[str, int]]:
    """Per config, the ptxas report of its kernel from the build log: registers, spill stores/loads,
    stack bytes and the mainloop pipeline stages. Empty if there is no log."""
    so_path = so_path or _LIB_PATH or build()
    try:
        log = open(os.path.join(os.path.dirname(so_path), "build.log")).read().splitlines()
    except OSError:
        return {}
    out: Dict[str, Dict[str, int]] = {}
    name = None
    for ln in log:
        m = re.search(r"Compiling entry function '([^']+)'", ln)
        if m:
            name = _kernel_config(m.group(1))
            st = re.search(r"BlockwiseFP8ILi(\d+)E", m.group(1))
            out[name] = {"stages": int(st.group(1)) if st else -1}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", ln)
        if m:
            out[name]["registers"] = int(m.group(1))
    return out


def _load():
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    path = build()
    lib = ctypes.CDLL(path)
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for name in CONFIGS:
        f = getattr(lib, f"w4a4_cutlass_gemm_{name}")
        f.argtypes = [vp, vp, vp, vp, vp, vp, i32, i32, i32, vp, sz, vp]
        f.restype = i32
        g = getattr(lib, f"w4a4_cutlass_workspace_{name}")
        g.argtypes = [i32, i32, i32]
        g.restype = ctypes.c_int64
    for name in ("w4a4_cutlass_configs", "w4a4_cutlass_last_error_detail"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.w4a4_cutlass_error_string.argtypes = [i32]
    lib.w4a4_cutlass_error_string.restype = ctypes.c_char_p
    lib.w4a4_cutlass_set_scheduler.argtypes = [i32, i32]
    lib.w4a4_cutlass_set_scheduler.restype = i32
    if lib.w4a4_cutlass_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.w4a4_cutlass_abi_version()}, expected {ABI_VERSION}")
    built = lib.w4a4_cutlass_configs().decode().split(",")
    if built != CONFIGS:
        raise RuntimeError(f"{path} exports configs {built}, the module expects {CONFIGS}")
    _LIB, _LIB_PATH = lib, path
    return lib


def configs() -> List[str]:
    """Names of the compiled tile configurations (valid ``config=`` values besides "auto")."""
    return list(CONFIGS)


def error_string(code: int) -> str:
    if _LIB is not None:
        return _LIB.w4a4_cutlass_error_string(int(code)).decode()
    return ERROR_NAMES.get(int(code), "unknown error code")


def is_available(build_if_needed: bool = True) -> bool:
    """True when the kernel can run here: CUDA, a compute-capability-9.x GPU, CUTLASS headers, and the
    library builds (nvcc; the first build takes minutes) or is already built, and loads. With
    ``build_if_needed=False`` a missing library is not compiled (returns False). Never raises."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            return False
        if not build_if_needed and _LIB is None and built_library() is None:
            return False
        _load()
        _AVAILABLE = True
    except Exception:  # noqa: BLE001 - is_available never raises
        _AVAILABLE = False
    return _AVAILABLE


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------
_AUTO: Dict[tuple, str] = {}
_WORKSPACE: Dict[tuple, int] = {}


def set_scheduler(max_swizzle: int = 1, raster_order: str = "heuristic") -> None:
    """Persistent tile order of every config: CUTLASS's ``max_swizzle_size`` (1, 2, 4, 8) and raster
    order ("heuristic", "along_m", "along_n"). Process-wide; for benchmarks."""
    orders = {"heuristic": 0, "along_m": 1, "along_n": 2}
    if raster_order not in orders or max_swizzle not in (1, 2, 4, 8):
        raise ValueError(f"max_swizzle must be 1, 2, 4 or 8 and raster_order one of {sorted(orders)}")
    if _load().w4a4_cutlass_set_scheduler(int(max_swizzle), orders[raster_order]) != 0:
        raise RuntimeError("w4a4_cutlass_set_scheduler rejected the options")


def set_auto_config(M: int, N: int, K: int, name: str) -> None:
    """Make config="auto" pick ``name`` for this (M, N, K) (e.g. from a benchmark)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose from {CONFIGS}")
    _AUTO[(int(M), int(N), int(K))] = name


def has_auto_config(M: int, N: int, K: int) -> bool:
    """Whether :func:`set_auto_config` named the config of "auto" for this (M, N, K)."""
    return (int(M), int(N), int(K)) in _AUTO


def _auto_config(M: int, N: int, K: int, device: torch.device) -> str:
    if (M, N, K) in _AUTO:
        return _AUTO[(M, N, K)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = -(-M // 128) * -(-N // 128)
    return "coop_128x128" if tiles >= sms else "pingpong_64x128"


def group_major(scale: torch.Tensor) -> torch.Tensor:
    """Same values, [rows, G] with strides (1, rows): the scale layout :func:`w4a4_gemm_fp8` expects."""
    if scale.dim() != 2:
        raise ValueError(f"scale must be 2-D [rows, K/64], got shape {tuple(scale.shape)}")
    return scale.t().contiguous().t()


def _is_group_major(s: torch.Tensor) -> bool:
    rows, g = s.shape
    return (rows <= 1 or s.stride(0) == 1) and (g <= 1 or s.stride(1) == rows)


def w4a4_gemm_fp8(a_fp8: torch.Tensor, ascale: torch.Tensor, w_fp8: torch.Tensor, wscale: torch.Tensor,
                  c: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                  config: str = "auto") -> torch.Tensor:
    """``out = bf16(sum_g ascale[:, g, None] * wscale[None, :, g] * (a_g @ w_g.T) + c)``; see the module doc.

    a_fp8 [M, K] and w_fp8 [N, K] float8_e4m3fn contiguous; ascale [M, K/64] and wscale [N, K/64]
    float32 with strides (1, rows) (:func:`group_major`); c None or bf16 [M, N] contiguous.
    """
    named = {"a_fp8": a_fp8, "ascale": ascale, "w_fp8": w_fp8, "wscale": wscale, **({"c": c} if c is not None else {})}
    want = {"a_fp8": torch.float8_e4m3fn, "w_fp8": torch.float8_e4m3fn, "ascale": torch.float32,
            "wscale": torch.float32, "c": torch.bfloat16}
    for n, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want[n]:
            raise ValueError(f"{n} must be {want[n]}, got {t.dtype}")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"out_dtype must be torch.bfloat16 (the only compiled epilogue), got {out_dtype}")
    if a_fp8.dim() != 2 or w_fp8.dim() != 2:
        raise ValueError(f"a_fp8 and w_fp8 must be 2-D, got {tuple(a_fp8.shape)} and {tuple(w_fp8.shape)}")
    (M, K), (N, Kw) = a_fp8.shape, w_fp8.shape
    if K != Kw:
        raise ValueError(f"K mismatch: a_fp8 {tuple(a_fp8.shape)} vs w_fp8 {tuple(w_fp8.shape)}")
    if K == 0 or K % GROUP_K or N % 16:
        raise ValueError(f"K must be a positive multiple of {GROUP_K} and N a multiple of 16, got K={K}, N={N}")
    for n, t, rows in (("ascale", ascale, M), ("wscale", wscale, N)):
        if tuple(t.shape) != (rows, K // GROUP_K):
            raise ValueError(f"{n} must have shape ({rows}, {K // GROUP_K}) = (rows, K/64), got {tuple(t.shape)}")
        if not _is_group_major(t):
            raise ValueError(f"{n} must have strides (1, {rows}) (group-major: G blocks of {rows} contiguous "
                             f"floats), got {t.stride()}; convert once with group_major({n})")
    if c is not None and tuple(c.shape) != (M, N):
        raise ValueError(f"c must have shape ({M}, {N}), got {tuple(c.shape)}")
    devs = {n: str(t.device) for n, t in named.items()}
    if any(t.device.type != "cuda" for t in named.values()) or len(set(devs.values())) != 1:
        raise ValueError(f"w4a4_gemm_fp8 needs CUDA tensors (an sm_90 GPU) on one device, got {devs}")
    for n in ("a_fp8", "w_fp8", "c"):
        if n in named and (not named[n].is_contiguous() or named[n].data_ptr() % 16):
            raise ValueError(f"{n} must be contiguous (row-major) and 16-byte aligned (TMA), got strides "
                             f"{named[n].stride()}")
    if config != "auto" and config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choose 'auto' or one of {CONFIGS}")

    device = a_fp8.device
    out = torch.empty((M, N), dtype=torch.bfloat16, device=device)
    if M == 0:
        return out
    lib = _load()
    name = _auto_config(M, N, K, device) if config == "auto" else config
    with torch.cuda.device(device):
        ws_key = (name, M, N, K, device.index)
        ws_bytes = _WORKSPACE.get(ws_key)
        if ws_bytes is None:
            ws_bytes = _WORKSPACE[ws_key] = int(getattr(lib, f"w4a4_cutlass_workspace_{name}")(M, N, K))
        if ws_bytes < 0:
            raise RuntimeError(f"w4a4_cutlass workspace query failed: {error_string(-ws_bytes)}")
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes > 0 else None
        stream = torch.cuda.current_stream(device).cuda_stream
        code = getattr(lib, f"w4a4_cutlass_gemm_{name}")(
            a_fp8.data_ptr(), ascale.data_ptr(), w_fp8.data_ptr(), wscale.data_ptr(),
            c.data_ptr() if c is not None else None, out.data_ptr(), M, N, K,
            ws.data_ptr() if ws is not None else None, ws_bytes, stream)
    if code != 0:
        detail = lib.w4a4_cutlass_last_error_detail().decode()
        raise RuntimeError(f"w4a4_cutlass[{name}] M={M} N={N} K={K}: error {code}: {error_string(code)}"
                           + (f" ({detail})" if detail else ""))
    return out
