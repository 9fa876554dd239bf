"""SVDQuant W4 x e4m3 GEMM on Hopper through lookup tables (``w4a8_lut_cutlass.cu``), a C-ABI library.

    out[m, n] = bf16( sx[m] * (sw[n] * sum_k LUT[n, k // 64](codes[n, k]) * x8[m, k]) + bias[n] )

``codes`` uint8 [N, K/2] (4-bit codes in the kernel's layout, ``w4_lut.shuffle_codes``), ``tables``
uint8 [K/64, N, 8] (eight e4m3 bytes per row and K-group: a code >= 8 reads ``T[code - 8]``, a code 1..7 reads
``-T[code]``, code 0 is 0), ``x8`` float8_e4m3fn [M, K], ``sw`` fp32 [N], ``sx`` fp32 [M], ``bias`` bf16 [N] or None.
``dit_passes.quant.w4_lut`` makes codes and tables from SVDQuant's stored tensors and holds the reference.

Why: Hopper has no 4-bit tensor cores. The expansion design (``w4_expand_triton``) writes every weight as e4m3 and
reads it back each call, 1.5 bytes a weight of memory traffic beside a GEMM that is compute bound; here the int4
codes go from shared memory to registers and become e4m3 by three byte permutes (``prmt``) per four codes, inside the
GEMM (CUTLASS's mixed-input mainloop, the weight as the register-sourced wgmma operand), and the group scales are
in the tables, so no per-group multiply. The mainloop wants two or more k-blocks of 32 a tile (it asserts four):
SVDQuant's K-group of 64 is the tile's K, one relaxed ``static_assert`` in a patched copy of one header.

Built by ``cutlass_build`` (nvcc, the ``nvidia-cutlass`` headers; cached, reused where built elsewhere).
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Dict, Optional

import torch

from . import cutlass_build

CONFIGS = ["coop_128x256", "coop_128x256_c2x1", "pingpong_64x256", "coop_128x128", "coop_256x128"]
DEFAULT_CONFIG = "coop_128x256"  # fastest on FLUX's shapes: bench/results/lut_gemm_configs_h100.md; "auto" times all
TUNE_CALLS = 3
GROUP_K = 64
ABI_VERSION = 1
_MAINLOOP = "cutlass/gemm/collective/sm90_mma_tma_gmma_rs_warpspecialized_mixed_input.hpp"
LIBRARY = cutlass_build.CutlassLibrary(
    name="w4a8_lut_cutlass", source="w4a8_lut_cutlass.cu", configs=tuple(CONFIGS),
    config_macro="W4A8_LUT_CONFIG_INDEX",
    patches=((_MAINLOOP, (
        ("#pragma once", "#pragma once\n#define W4A8_LUT_PATCHED_SM90_MIXED_INPUT 1", 1),
        ('static_assert(K_BLOCK_MAX >= 4, "Consider increasing TileShapeK");',
         'static_assert(K_BLOCK_MAX >= 2, "[w4a8_lut patch] two k-blocks a tile at least");', 1))),))

_LIB = None
_WORKSPACE: Dict[tuple, int] = {}
_TUNED: Dict[tuple, str] = {}   # (M, N, K, device) -> the config "auto" measured fastest


def _load():
    global _LIB
    if _LIB is not None:
        return _LIB
    if cutlass_build.built_library(LIBRARY) is None:
        cutlass_build.find_nvcc(), cutlass_build.find_cutlass_include()  # CutlassUnavailable, unwarned, if unbuildable
        warnings.warn("dit_passes: building the LUT GEMM library (nvcc, first use on this machine: minutes; cached "
                      "under $DIT_PASSES_CUTLASS_CACHE)")
    path = cutlass_build.build(LIBRARY)
    lib = ctypes.CDLL(path)
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for name in CONFIGS:
        f = getattr(lib, f"w4a8_lut_gemm_{name}")
        f.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, i32, i32, vp, sz, vp]
        f.restype = i32
        g = getattr(lib, f"w4a8_lut_workspace_{name}")
        g.argtypes = [i32, i32, i32]
        g.restype = ctypes.c_int64
    lib.w4a8_lut_shuffle_offsets.argtypes = [i32, i32, vp]
    lib.w4a8_lut_shuffle_offsets.restype = i32
    for name in ("w4a8_lut_configs", "w4a8_lut_last_error_detail"):
        getattr(lib, name).restype = ctypes.c_char_p
    if lib.w4a8_lut_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.w4a8_lut_abi_version()}, expected {ABI_VERSION}")
    if lib.w4a8_lut_configs().decode().split(",") != CONFIGS:
        raise RuntimeError(f"{path} exports configs {lib.w4a8_lut_configs().decode()}, expected {CONFIGS}")
    _LIB = lib
    return lib


def is_available(build_if_needed: bool = True) -> bool:
    """A compute-capability-9 GPU and the library (built, or buildable when ``build_if_needed``). Never raises."""
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            return False
        if not build_if_needed and _LIB is None and cutlass_build.built_library(LIBRARY) is None:
            return False
        _load()
        return True
    except Exception:  # noqa: BLE001 - a query
        return False


def shuffle_offsets(n: int, k: int) -> torch.Tensor:
    """int64 [N * K] (CPU): where the library's shuffled layout puts code (n, k) (row-major index n * K + k); the
    layout ``w4_lut.shuffle_index`` computes (tests compare them)."""
    out = torch.empty(n * k, dtype=torch.int32)
    if _load().w4a8_lut_shuffle_offsets(n, k, out.data_ptr()) != 0:
        raise RuntimeError(f"w4a8_lut_shuffle_offsets({n}, {k}): {_load().w4a8_lut_last_error_detail().decode()}")
    return out.long()


def lut_gemm(codes: torch.Tensor, tables: torch.Tensor, x8: torch.Tensor, sw: torch.Tensor, sx: torch.Tensor,
             bias: Optional[torch.Tensor], config: Optional[str] = None) -> torch.Tensor:
    """The GEMM (module docstring) with tile config ``config`` (a name, or "auto", the default: the first call of a shape times every config, :data:`TUNE_CALLS` calls each, and keeps the fastest; a call while a
    CUDA graph is being captured takes :data:`DEFAULT_CONFIG` for a shape not timed yet). Every config sums K in the
    same order: the output does not depend on the choice."""
    config = config or "auto"
    if config != "auto" and config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; choose 'auto' or one of {CONFIGS}")
    (m, k), n = x8.shape, codes.shape[0]
    want = {"codes": (codes, (n, k // 2), torch.uint8), "tables": (tables, (k // GROUP_K, n, 8), torch.uint8),
            "x8": (x8, (m, k), torch.float8_e4m3fn), "sw": (sw, (n,), torch.float32),
            "sx": (sx, (m,), torch.float32)}
    if bias is not None:
        want["bias"] = (bias, (n,), torch.bfloat16)
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cuda":
            raise ValueError(f"w4a8_lut_gemm: {name} must be a contiguous CUDA {dtype} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")
    if k % GROUP_K or n % 16 or m % 8:
        raise ValueError(f"w4a8_lut_gemm needs K % 64 == 0, N % 16 == 0, M % 8 == 0; got M={m} N={n} K={k}")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x8.device)

    def run(name: str) -> None:
        _launch(name, codes, tables, x8, sw, sx, bias, out)
    run(_tuned(m, n, k, x8.device, run) if config == "auto" else config)
    return out


def _launch(config, codes, tables, x8, sw, sx, bias, out) -> None:
    lib = _load()
    (m, k), n = x8.shape, codes.shape[0]
    ws_key = (config, m, n, k)
    if ws_key not in _WORKSPACE:
        _WORKSPACE[ws_key] = int(getattr(lib, f"w4a8_lut_workspace_{config}")(m, n, k))
    ws_bytes = _WORKSPACE[ws_key]
    if ws_bytes < 0:
        raise RuntimeError(f"w4a8_lut workspace query failed (error {-ws_bytes})")
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=x8.device) if ws_bytes else None
    code = getattr(lib, f"w4a8_lut_gemm_{config}")(
        codes.data_ptr(), tables.data_ptr(), x8.data_ptr(), sw.data_ptr(), sx.data_ptr(),
        bias.data_ptr() if bias is not None else None, out.data_ptr(), m, n, k,
        ws.data_ptr() if ws is not None else None, ws_bytes, torch.cuda.current_stream(x8.device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"w4a8_lut_gemm[{config}] M={m} N={n} K={k}: error {code} "
                           f"({lib.w4a8_lut_last_error_detail().decode()})")


def _tuned(m: int, n: int, k: int, device: torch.device, run) -> str:
    key = (m, n, k, device.index)
    if key not in _TUNED:
        if torch.cuda.is_current_stream_capturing():
            return DEFAULT_CONFIG
        times = {}
        for name in CONFIGS:
            run(name)  # warm: the first launch of a config loads its kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(TUNE_CALLS):
                run(name)
            end.record()
            end.synchronize()
            times[name] = start.elapsed_time(end)
        _TUNED[key] = min(times, key=times.get)
    return _TUNED[key]


def tuned_configs() -> Dict[tuple, str]:
    """What "auto" chose so far: (M, N, K, device index) -> config."""
    return dict(_TUNED)
