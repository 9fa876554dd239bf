"""Which implementation runs each quantized op and which form each quantized linear is written in: the one place
that reads the device, the forms a pass was given (``forms.QuantForms``) and the timing table (``custom_ops.py`` and
``patterns/quant_linear.py`` ask here; the kernels in ``dit_passes.kernels`` decide nothing, they take the choice as a
parameter).

Per-device defaults: :func:`device_default` (a QuantForms field left at ``"auto"`` / ``None`` -> the concrete
choice for a compute capability, each citing the results file that chose it). The rest below is per linear:

* ``dit_passes::svdq_w4a4_linear`` on CUDA, :func:`use_cutlass` then :func:`w4a4_linear_with_kernel`: the op's
  ``backend`` argument (``SVDQuantW4A4(form=...)``) = ``triton`` | ``cutlass`` (builds the CUTLASS library if needed)
  | ``auto`` (default: CUTLASS only when its library is already built and loads, then per shape from the timing table
  (:func:`table_path`, written by ``bench/cutlass_w4a4_e2e.py``): the entry of the same (N, K) with the nearest M --
  its backend and CUTLASS tile config (:func:`cutlass_config`); CUTLASS with the default config without one). Only
  bf16 activations, K % 64 == 0, N % 16 == 0 on a compute-capability-9 GPU take the CUTLASS path. Otherwise the
  Triton kernels (``dit_passes.kernels.w4a4_triton``, sm_80+) when they import, else the reference.
* ``dit_passes::fp8_linear`` on CUDA, :func:`fp8_backend`: ``torch._scaled_mm`` on sm_89+ with K and N
  multiples of 16 (row-wise scales only with bf16 activations), else the reference.
* The graph forms (``graph_forms.py``: plain ATen ops written into the graph by the quantize passes, decided when
  the graph is written, from x's fake value): the fp8 linears' GEMM is :func:`fp8_gemm_backend` (the same rule
  as :func:`fp8_backend`), with ``use_fast_accum`` as ``fast_accum`` asks (:func:`fp8_fast_accum`);
  SVDQuant's linears (:func:`svdq_form`) are written as the lrcat_split form below on Hopper by default, as W4A8 on
  fp8 tensor cores (``graph_forms.svdq_fp8_linear_form``) with ``form="fp8"`` (its GEMM follows
  :func:`fp8_gemm_backend`: the reference on CPU), else as the custom op (true W4A4, above).
* ``form="lrcat"``: SVDQuant's linears are written as the fp8 form with the low-rank branch folded into the GEMM's
  K (``graph_forms.svdq_lrcat_linear_form``: one ``_scaled_mm`` over [qx | qh] and [w8 | u8], the branch in e4m3), on
  any device (the reference GEMM off the GPU); its B operand by ATen ops or, with ``w4_expand="kernel"``, by the op
  ``dit_passes::w4_lrcat_to_e4m3``; ``lrcat_split``: the branch's operands as e4m3 hi / lo pairs (3R columns, ~8
  significant bits).
* ``form="lut"`` (and ``auto`` on Hopper where its library builds): SVDQuant's tables stored for the lookup-table
  GEMM (``w4_lut.py``); which kernels run it is ``lut_dispatch.py``'s, beside this module.
* ``form`` = ``w4a8`` / ``w4a8_fold``: SVDQuant's linears are written as the op ``dit_passes::svdq_w4a8_linear``
  (``fold`` False / True), which runs the fused W4A8 Triton kernels (``dit_passes.kernels.w4a8_triton``) on sm_89+
  GPUs, else its reference (:func:`w4a8_linear_cuda`).
* ``dit_passes::svdq_nvfp4_linear`` (NVFP4 SVDQuant), :func:`nvfp4_form`: written as the exact split GEMM on fp8
  tensor cores (``graph_forms.svdq_nvfp4_fp8_linear_form``) by default wherever ``_scaled_mm`` takes it (sm_89+,
  bf16) and anywhere with ``form="fp8"`` (the reference GEMM off the GPU); else the op (the reference).
* The fp8 graph form's per-token activation quantization, :func:`fp8_act_quant`: ``act_quant`` = ``graph`` (ATen
  ops, which Inductor fuses into the producer as a reduction and a pointwise kernel) | ``kernel`` (the op
  ``dit_passes::fp8_quantize_rows``, written on any device; on CUDA one Triton kernel reading x once on sm_89+
  (:func:`fp8_quantize_rows_cuda`), else its reference). The same setting writes the lrcat form's A operand as the op
  ``dit_passes::lrcat_quantize_rows`` (:func:`lrcat_quantize_rows_cuda`) where ``lrcat_act="stats"``; by default
  (``mm``) as ``aten.mm`` for the down projection and the op ``dit_passes::lrcat_quantize_smoothed``
  (:func:`lrcat_act_quant`).
* The SVDQuant fp8 graph form's weight expansion (int4 -> e4m3, group scales folded), :func:`w4_expand`:
  ``w4_expand`` = ``graph`` (ATen ops, ``graph_forms.w4_to_e4m3``, fused by Inductor) | ``kernel`` (the op
  ``dit_passes::w4_to_e4m3``, written on any device; on CUDA one bandwidth-bound Triton kernel on sm_89+
  (:func:`w4_to_e4m3_cuda`), else its reference).
* The weight-only forms (``w8a16`` / ``fp8_weight_only`` / ``w4a16`` / ``w4a16_lr`` / ``nvfp4_weight_only``: the
  AdaLN modulation linears under SVDQuant), :func:`weight_only_form`: ``weight_only_form`` = ``linear`` (the
  dequantized weight and ``aten.linear``) | ``rows`` (on at most :data:`FEW_ROWS` rows of x, a multiply-and-sum that
  Inductor fuses with the dequantization, ``weight_only_forms.dequantized_linear``) | ``kernel`` (the int4 forms on
  those rows as the op ``dit_passes::w4a16_rows_linear``: on CUDA one Triton GEMV pass over the packed weight,
  :func:`w4a16_rows_cuda`).
* ``dit_passes::int8_linear`` on CUDA, :func:`int8_backend`: ``torch._int_mm`` for M > 16 and K, N multiples
  of 8, else the exact reference dot.

The kernel modules are imported on first use (never on CPU); an ImportError there (e.g. triton missing)
warns and falls back, any other error propagates: a broken kernel must be loud, not silently replaced.
"""
from __future__ import annotations

import functools
import importlib
import json
import math
import os
import warnings
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

import torch

from ..infra import env
from .fp8_int8 import quantize_fp8_act
from .forms import ACT_QUANT_SETTINGS, LRCAT_ACT_SETTINGS, SVDQ_FORMS, W4_EXPAND_SETTINGS, WEIGHT_ONLY_SETTINGS
from .graph_forms import lrcat_activation, lrcat_smoothed_activation, lrcat_weight
from .graph_forms import w4_to_e4m3 as w4_to_e4m3_reference
from .int4 import w4a4_linear_reference
from .w4a8 import w4a8_linear_reference
from .weight_only_forms import w4a16_linear_form

LRCAT_FORMS = ("lrcat", "lrcat_split")  # svdq_form's answers that write graph_forms.svdq_lrcat_linear_form
W4A8_FORMS = ("w4a8", "w4a8_fold")  # svdq_form's answers that write dit_passes::svdq_w4a8_linear
OP_BACKENDS = ("auto", "triton", "cutlass")  # dit_passes::svdq_w4a4_linear's backend argument
FEW_ROWS = 4  # the most rows of x written as weight_only_forms.dequantized_linear's multiply-and-sum (CFG: 2 per step)
GROUP = 64


# ------------------------------------------------------------------------------------ kernel modules
def _import_kernel(name: str, fallback: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(f"dit_passes.kernels.{name}")
    except ImportError as e:
        warnings.warn(f"dit_passes.kernels.{name} failed to import ({e}); W4A4 runs {fallback} on CUDA")
        return None


@functools.lru_cache(maxsize=None)
def w4a4_kernel_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4a4_triton`` (``fused_act_quant``, ``w4a4_gemm``, ``is_supported``), or None when
    its dependencies (triton) are missing. Memoised: the answer cannot change within a process."""
    return _import_kernel("w4a4_triton", "the reference")


@functools.lru_cache(maxsize=None)
def w4a4_cutlass_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4a4_cutlass_linear`` (``w4a4_linear``), or None."""
    return _import_kernel("w4a4_cutlass_linear", "Triton")


@functools.lru_cache(maxsize=None)
def w4a8_kernel_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4a8_triton`` (``w4a8_linear``, ``is_supported``), or None."""
    return _import_kernel("w4a8_triton", "the reference")


def _cutlass_gemm() -> ModuleType:
    # The GEMM's loader module imports no triton: usable for the table and availability on any machine.
    return importlib.import_module("dit_passes.kernels.w4a4_cutlass")


# ---------------------------------------------------------------------------------------------- W4A4
def w4a4_linear_with_kernel(kernel: Optional[ModuleType], x, qweight, wscale, lora_down, lora_up, smooth_inv,
                            bias) -> torch.Tensor:
    """The W4A4 linear through ``kernel``'s two functions (``fused_act_quant(x2d, smooth_inv, lora_down) ->
    (qx_packed, ascale, lora_act)``, ``w4a4_gemm(qx, ascale, qweight, wscale, lora_act, lora_up, bias,
    out_dtype)``); the reference when ``kernel`` is None or its ``is_supported(x2d, qweight)`` declines."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if kernel is None or (hasattr(kernel, "is_supported") and not kernel.is_supported(x2d, qweight)):
        return w4a4_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    qx, ascale, lora_act = kernel.fused_act_quant(x2d, smooth_inv, lora_down)
    out = kernel.w4a4_gemm(qx, ascale, qweight, wscale, lora_act, lora_up, bias, x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


# ------------------------------------------------------------------------------- per-device defaults
def device_capability(x: Optional[torch.Tensor]) -> Optional[Tuple[int, int]]:
    """The compute capability of the GPU x (a real or fake tensor) lives on; None off CUDA (or without x)."""
    if x is None or x.device.type != "cuda":
        return None
    return tuple(capability(x.device))


def device_default(name: str, cap: Optional[Tuple[int, int]], int4: bool = True) -> Any:
    """The concrete choice for the ``forms.QuantForms`` field ``name`` left at its default (``"auto"`` / ``None``)
    on a device of compute capability ``cap`` (None: not a CUDA GPU). ``int4``: the weight-only kind is an int4 one
    (``weight_only_form``). What the per-linear functions below then still decide from the shape: ``form``'s
    ``"lut"`` where the LUT library runs, else ``"lrcat_split"`` where ``_scaled_mm`` takes the shape, else ``"op"``."""
    fp8_gpu = cap is not None and tuple(cap) >= (8, 9)
    if name == "form":
        # Hopper (fp8 but no 4-bit tensor cores): the lookup-table form, the fastest SVDQuant form of the FLUX step
        # at SVDQuant's fidelity (bench/results/quant_step_h100.md, quant_step_h200.md, quant_fidelity_lut2.md);
        # elsewhere true W4A4, the reference numerics and the choice for GPUs with 4-bit tensor cores
        return "lut" if cap is not None and cap[0] == 9 else "op"
    if name == "fast_accum":
        # the inference default of fp8 GEMMs (torchao's); the fp8 and SVDQuant step figures ran with it
        # (bench/results/fastest_stack_fp8_forms_h100.md)
        return True
    if name in ("act_quant", "w4_expand"):
        # our Triton kernels on sm_89+ (bench/results/fastest_stack_fp8_forms_h100.md; the expansion at several times
        # the bandwidth of Inductor's fusion: w4_expand_kernel_h100.json), ATen ops elsewhere
        return "kernel" if fp8_gpu else "graph"
    if name == "lrcat_act":
        # the down projection by aten.mm, then one row pass: the faster on the H100 step
        # (bench/results/quant_step_lrcat_act_h100.json)
        return "mm"
    if name == "weight_only_form":
        # int4 on a GPU: one read of the packed weight instead of a dequantized copy read again (FLUX's modulation);
        # else the linear (the rows form holds an [rows, N, K] product where no compiler fuses it)
        return "kernel" if int4 and cap is not None else "linear"
    if name == "lut_planes":
        # two planes (h in e4m3, the GEMM 64 columns shorter at rank 32): the faster in each run that had both, at
        # SVDQuant's fidelity (bench/results/quant_step_h100.md, quant_step_h200.md, quant_fidelity_lut2.md)
        return 2
    if name == "lut_act":
        # the row kernel after a cuBLAS mm; "lowrank" measured no faster (bench/results/quant_step_h200.md)
        return "rows"
    raise KeyError(f"no device default for {name!r}")


def table_path() -> str:
    """The timing table ``env.w4a4_table()`` names, else the one beside the built CUTLASS libraries (their cache
    root)."""
    build = importlib.import_module("dit_passes.kernels.cutlass_build")  # no triton, no nvcc needed to import
    return env.w4a4_table() or os.path.join(build.cache_root(), "w4a4_backend_table.json")


_TABLES: Dict[tuple, Dict[tuple, list]] = {}


def _table(path: str) -> Dict[tuple, list]:
    try:
        stamp = (path, os.stat(path).st_mtime_ns)
    except OSError:
        return {}
    if stamp not in _TABLES:
        out: Dict[tuple, list] = {}
        configs = _cutlass_gemm().CONFIGS
        try:
            for e in json.load(open(path)).get("entries", []):
                if e.get("backend") in ("triton", "cutlass"):
                    cfg = e.get("config") if e.get("config") in configs else None
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


def cutlass_config(m: int, n: int, k: int) -> str:
    """The CUTLASS tile config for this shape: ``env.cutlass_config()`` (a forced config), else a
    ``set_auto_config`` entry (applied by the GEMM's "auto"), else the timing table's config, else "auto"."""
    gemm = _cutlass_gemm()
    forced = env.cutlass_config()
    if forced:
        if forced not in gemm.CONFIGS:
            raise ValueError(f"{env.CUTLASS_CONFIG}={forced!r} is not one of {gemm.CONFIGS}")
        return forced
    if gemm.has_auto_config(m, n, k):
        return "auto"
    e = table_entry(m, n, k)
    return e[2] if e is not None and e[2] else "auto"


def cutlass_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Shape, dtype and device the CUTLASS path handles (not whether its library is present)."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and qweight.is_cuda and qweight.dtype == torch.uint8
            and qweight.dim() == 2 and x.shape[-1] % GROUP == 0 and x.shape[-1] == 2 * qweight.shape[1]
            and qweight.shape[0] % 16 == 0 and capability(x.device)[0] == 9)


_READY: Dict[bool, bool] = {}
_WARNED = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg)


def cutlass_ready(build_if_needed: bool) -> bool:
    """``w4a4_cutlass.is_available``, memoised here (a negative answer too, until :func:`reset`)."""
    if build_if_needed not in _READY:
        _READY[build_if_needed] = _cutlass_gemm().is_available(build_if_needed=build_if_needed)
    return _READY[build_if_needed]


def reset() -> None:
    """Forget the memoised library availability and tables (after a build, or a new table)."""
    _READY.clear()
    _TABLES.clear()
    _cutlass_gemm()._AVAILABLE = None


def check_op_backend(backend: str) -> str:
    if backend not in OP_BACKENDS:
        raise ValueError(f"dit_passes::svdq_w4a4_linear's backend must be one of {OP_BACKENDS}, got {backend!r}")
    return backend


def use_cutlass(x: torch.Tensor, qweight: torch.Tensor, backend: str = "auto") -> bool:
    """Whether ``dit_passes::svdq_w4a4_linear`` with ``backend`` (``OP_BACKENDS``) runs this call through the
    CUTLASS linear."""
    setting = check_op_backend(backend)
    if setting == "triton":
        return False
    if not cutlass_supported(x, qweight):
        if setting == "cutlass" and x.is_cuda:
            _warn_once(f"form='cutlass': this linear (x {x.dtype} K={x.shape[-1]}, N={qweight.shape[0]}) "
                       "needs bf16, K % 64 == 0, N % 16 == 0 on an sm_90 GPU; it runs on Triton")
        return False
    if not cutlass_ready(build_if_needed=setting == "cutlass"):
        if setting == "cutlass":
            _warn_once(f"form='cutlass' but the CUTLASS library is unavailable (headers: "
                       f"`{_cutlass_gemm().PIP_HINT}`, nvcc); W4A4 runs on Triton")
        return False
    if w4a4_cutlass_module() is None:
        return False
    m = x.numel() // max(x.shape[-1], 1)
    return setting == "cutlass" or table_choice(m, qweight.shape[0], x.shape[-1]) in (None, "cutlass")


def w4a4_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, backend: str = "auto") -> torch.Tensor:
    """The CUDA implementation of ``dit_passes::svdq_w4a4_linear``: CUTLASS, Triton or the reference."""
    if use_cutlass(x, qweight, backend):
        m, n, k = x.numel() // x.shape[-1], qweight.shape[0], x.shape[-1]
        return w4a4_cutlass_module().w4a4_linear(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias,
                                                 config=cutlass_config(m, n, k))
    return w4a4_linear_with_kernel(w4a4_kernel_module(), x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


def w4a8_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold: bool) -> torch.Tensor:
    """The CUDA implementation of ``dit_passes::svdq_w4a8_linear``: the fused Triton kernels where they run this
    linear, else the reference."""
    kernel = w4a8_kernel_module()
    if kernel is not None and kernel.is_supported(x.reshape(-1, x.shape[-1]), qweight):
        return kernel.w4a8_linear(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold=fold)
    return w4a8_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold)


# ------------------------------------------------------------------------------------------ fp8 / int8
def capability(device: torch.device) -> tuple:
    """The CUDA compute capability of ``device`` (major, minor)."""
    return torch.cuda.get_device_capability(device)


def on_fp8_gpu(x: Optional[torch.Tensor]) -> bool:
    """Whether x (a real or fake tensor) lives on a GPU with fp8 tensor cores and the e4m3 cast (sm_89+)."""
    cap = device_capability(x)
    return cap is not None and cap >= (8, 9)


def fp8_backend(x: torch.Tensor, qweight: torch.Tensor, granularity: str) -> str:
    """``"scaled_mm"`` where ``torch._scaled_mm`` handles the call, else ``"reference"``."""
    n, k = qweight.shape
    return fp8_gemm_backend(x, n, k, granularity)


def fp8_gemm_backend(x: torch.Tensor, n: int, k: int, granularity: str) -> str:
    """The GEMM of an fp8 linear [K -> N] on activations like ``x`` (a real or fake tensor): ``"scaled_mm"`` on
    an sm_89+ GPU with K and N multiples of 16 (row-wise scales: bf16 activations only), else ``"reference"``."""
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return "reference"
    if capability(x.device) < (8, 9):
        return "reference"
    if k % 16 or n % 16:
        return "reference"
    # Row-wise scaling in cuBLASLt is only wired for bf16 output.
    ok = x.dtype == torch.bfloat16 if granularity == "per_row" else x.dtype in (torch.bfloat16, torch.float16,
                                                                                 torch.float32)
    return "scaled_mm" if ok else "reference"


def fp8_fast_accum(setting: Optional[bool] = None, x: Optional[torch.Tensor] = None) -> bool:
    """``_scaled_mm``'s ``use_fast_accum`` (sm_90's fp8 MMA accumulates in reduced precision between promotions:
    faster, slightly less exact) as ``fast_accum`` asks; None: :func:`device_default` for x's device (on)."""
    if setting is not None:
        if not isinstance(setting, bool):
            raise ValueError(f"fast_accum must be None, True or False, got {setting!r}")
        return setting
    return device_default("fast_accum", device_capability(x))


def fp8_act_quant(granularity: str, x: Optional[torch.Tensor] = None, setting: str = "auto") -> str:
    """How the fp8 graph form quantizes activations like ``x`` (module docstring): ``"graph"`` or ``"kernel"``
    (per-row only: a per-tensor scale stays in the graph form) as ``act_quant`` (``setting``) asks; ``auto``:
    :func:`device_default` for x's device."""
    if setting not in ACT_QUANT_SETTINGS:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_SETTINGS}, got {setting!r}")
    s = device_default("act_quant", device_capability(x)) if setting == "auto" else setting
    return s if granularity == "per_row" else "graph"


@functools.lru_cache(maxsize=None)
def fp8_rowquant_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.fp8_rowquant_triton`` (``fp8_quantize_rows``, ``is_supported``), or None."""
    return _import_kernel("fp8_rowquant_triton", "the reference")


def fp8_quantize_rows_cuda(x: torch.Tensor):
    """``dit_passes::fp8_quantize_rows`` on CUDA: the Triton kernel where it takes x (sm_89+), else the reference
    (the same numbers)."""
    kernel = fp8_rowquant_module()
    if kernel is None or not kernel.is_supported(x):
        return quantize_fp8_act(x, "per_row")
    return kernel.fp8_quantize_rows(x)


def weight_only_form(x: torch.Tensor, int4: bool = True, setting: str = "auto") -> str:
    """How a weight-only linear (int8 / fp8 / int4 / NVFP4 weights, activations in their dtype) is written for
    activations like ``x`` (a real or fake tensor): for at most :data:`FEW_ROWS` rows of x, ``"rows"``
    (``weight_only_forms.dequantized_linear``'s multiply-and-sum, which Inductor fuses with the dequantization) or
    ``"kernel"`` (the int4 forms: the op ``dit_passes::w4a16_rows_linear``, one GEMV pass over the packed weight;
    the others take ``"rows"``) as ``weight_only_form`` (``setting``) asks; else ``"linear"`` (the dequantized
    weight, then ``aten.linear``). ``auto``: :func:`device_default` for x's device and ``int4``."""
    if setting not in WEIGHT_ONLY_SETTINGS:
        raise ValueError(f"weight_only_form must be one of {WEIGHT_ONLY_SETTINGS}, got {setting!r}")
    # the default asks only whether x is on a GPU, not which (a fake CUDA tensor needs no CUDA runtime here)
    on_gpu = (0, 0) if x.device.type == "cuda" else None
    s = device_default("weight_only_form", on_gpu, int4) if setting == "auto" else setting
    return s if math.prod(int(d) for d in x.shape[:-1]) <= FEW_ROWS else "linear"


@functools.lru_cache(maxsize=None)
def w4a16_rows_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4a16_rows_triton`` (``w4a16_rows_linear``, ``is_supported``), or None."""
    return _import_kernel("w4a16_rows_triton", "the reference")


def w4a16_rows_cuda(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: Optional[torch.Tensor]):
    """``dit_passes::w4a16_rows_linear`` on CUDA: the Triton kernel where it takes the tensors, else the reference."""
    kernel = w4a16_rows_module()
    if kernel is None or not kernel.is_supported(x, qweight):
        return w4a16_linear_form(x, qweight, wscale, bias, rows=True)
    return kernel.w4a16_rows_linear(x, qweight, wscale, bias)


def w4_expand(x: Optional[torch.Tensor] = None, setting: str = "auto") -> str:
    """How the SVDQuant fp8 graph forms expand their int4 weights to e4m3 for activations like ``x`` (module
    docstring): ``"graph"`` or ``"kernel"`` as ``w4_expand`` (``setting``) asks; ``auto``: :func:`device_default`
    for x's device."""
    if setting not in W4_EXPAND_SETTINGS:
        raise ValueError(f"w4_expand must be one of {W4_EXPAND_SETTINGS}, got {setting!r}")
    return device_default("w4_expand", device_capability(x)) if setting == "auto" else setting


@functools.lru_cache(maxsize=None)
def w4_expand_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4_expand_triton`` (``w4_to_e4m3``, ``is_supported``), or None."""
    return _import_kernel("w4_expand_triton", "the reference")


def w4_to_e4m3_cuda(qweight: torch.Tensor, wscale: torch.Tensor):
    """``dit_passes::w4_to_e4m3`` on CUDA: the Triton kernel where it takes the tensors (sm_89+), else the reference
    (the same bytes)."""
    kernel = w4_expand_module()
    if kernel is None or not kernel.is_supported(qweight, wscale):
        return w4_to_e4m3_reference(qweight, wscale, qweight.shape[0], 2 * qweight.shape[1])
    return kernel.w4_to_e4m3(qweight, wscale)


def w4_lrcat_to_e4m3_cuda(qweight, wscale, lora_up, c, split: bool):
    """``dit_passes::w4_lrcat_to_e4m3`` on CUDA: the Triton kernel where it takes the tensors (sm_89+), else the
    reference (the same bytes)."""
    kernel = w4_expand_module()
    if kernel is None or not kernel.is_supported(qweight, wscale):
        return lrcat_weight(qweight, wscale, lora_up, c, qweight.shape[0], 2 * qweight.shape[1], lora_up.shape[1],
                            split=split)
    return kernel.w4_lrcat_to_e4m3(qweight, wscale, lora_up, c, split)


@functools.lru_cache(maxsize=None)
def lrcat_act_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.lrcat_act_triton`` (``lrcat_quantize_rows``, ``is_supported``), or None."""
    return _import_kernel("lrcat_act_triton", "the reference")


def lrcat_quantize_rows_cuda(x, smooth_inv, lora_down, c, split: bool):
    """``dit_passes::lrcat_quantize_rows`` on CUDA: the Triton kernel where it takes the tensors (sm_89+), else the
    reference (``graph_forms.lrcat_activation``)."""
    kernel = lrcat_act_module()
    if kernel is None or not kernel.is_supported(x, lora_down):
        return lrcat_activation(x, smooth_inv, lora_down, c, x.shape[0], lora_down.shape[0], x.dtype, split)
    return kernel.lrcat_quantize_rows(x, smooth_inv, lora_down, c, split)


def lrcat_act_quant(x: torch.Tensor, act_quant: str = "auto", lrcat_act: str = "auto") -> str:
    """How the lrcat form writes its A operand for activations like ``x``: where :func:`fp8_act_quant` says
    ``"graph"``, the form's ATen ops; where it says ``"kernel"``, as ``lrcat_act`` asks: ``"mm"`` (the smoothed
    activation written in x.dtype by its producer under Inductor, its down projection by ``aten.mm`` and one row pass,
    ``dit_passes::lrcat_quantize_smoothed``) or ``"kernel"`` for ``lrcat_act="stats"``
    (``dit_passes::lrcat_quantize_rows``: the down projection and the row statistics in one Triton kernel, the
    quantization in a second); ``auto``: :func:`device_default`."""
    if lrcat_act not in LRCAT_ACT_SETTINGS:
        raise ValueError(f"lrcat_act must be one of {LRCAT_ACT_SETTINGS}, got {lrcat_act!r}")
    form = fp8_act_quant("per_row", x, act_quant)
    if form != "kernel":
        return form
    s = device_default("lrcat_act", device_capability(x)) if lrcat_act == "auto" else lrcat_act
    return "kernel" if s == "stats" else "mm"


def lrcat_quantize_smoothed_cuda(xd, h, c, split: bool):
    """``dit_passes::lrcat_quantize_smoothed`` on CUDA: the Triton kernel where it takes the tensors (sm_89+, K up to
    its one-pass width), else the reference (``graph_forms.lrcat_smoothed_activation``)."""
    kernel = lrcat_act_module()
    if kernel is None or not kernel.smoothed_supported(xd):
        return lrcat_smoothed_activation(xd, h, c, xd.shape[0], h.shape[1], split)
    return kernel.lrcat_quantize_smoothed(xd, h, c, split)


def svdq_form(x: torch.Tensor, qweight: torch.Tensor, setting: str = "auto") -> str:
    """How an SVDQuant linear (kept in its W4A4 tables: not the LUT form) is written into the graph for ``form``
    (``setting``): ``"fp8"`` (W4A8, the activations in e4m3 per token, on fp8 tensor cores where ``_scaled_mm`` runs,
    plain ATen ops), ``"lrcat"`` / ``"lrcat_split"`` (the same with the low-rank branch in the GEMM's K; its hi / lo
    variant), ``"w4a8"`` / ``"w4a8_fold"`` (the op ``dit_passes::svdq_w4a8_linear``: the fused W4A8 kernels, exact
    / folded group scales) on any device as asked; else ``"op"`` (``dit_passes::svdq_w4a4_linear``: true W4A4, the
    reference numerics; ``triton`` / ``cutlass`` name its kernel). ``auto``: :func:`device_default`; where that is
    the LUT form and the linear was not stored in it (its library did not build, or N), ``"lrcat_split"`` wherever
    ``_scaled_mm`` takes the shape (its step and fidelity: ``bench/results/quant_step_lrcat_act_h100.json``,
    ``quant_fidelity_hopper.md``), else the op."""
    if setting not in SVDQ_FORMS:
        raise ValueError(f"form must be one of {SVDQ_FORMS}, got {setting!r}")
    if setting == "fp8" or setting in LRCAT_FORMS or setting in W4A8_FORMS:
        return setting
    if setting != "auto" or device_default("form", device_capability(x)) != "lut":
        return "op"
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    # the branch's columns keep K a multiple of 16 (graph_forms.lrcat_cols): _scaled_mm takes [K + cols] when it takes K
    return "lrcat_split" if fp8_gemm_backend(x, n, k, "per_row") == "scaled_mm" else "op"


def op_backend(setting: str) -> str:
    """``dit_passes::svdq_w4a4_linear``'s ``backend`` argument for ``form`` = ``setting``: the kernel it names
    (``triton`` / ``cutlass``), else ``auto`` (the timing table, :func:`use_cutlass`)."""
    return setting if setting in OP_BACKENDS else "auto"


def nvfp4_form(x: torch.Tensor, n: int, k: int, setting: str = "auto") -> str:
    """How an NVFP4 SVDQuant linear [K -> N] is written for ``form`` (``setting``): ``"fp8"`` (the exact split GEMM
    on fp8 tensor cores, a graph form) or ``"op"`` (``dit_passes::svdq_nvfp4_linear``, the reference). No GPU here has
    a native NVFP4 path wired, so ``auto`` takes the fp8 form wherever ``_scaled_mm`` takes its [M, 4K] x [4K, N]
    GEMM; ``fp8`` on any device; any other form (no NVFP4 kernel of theirs) gets the op."""
    if setting not in SVDQ_FORMS:
        raise ValueError(f"form must be one of {SVDQ_FORMS}, got {setting!r}")
    if setting != "auto":
        return "fp8" if setting == "fp8" else "op"
    return "fp8" if fp8_gemm_backend(x, n, 4 * k, "per_row") == "scaled_mm" else "op"


def int8_backend(x: torch.Tensor, qweight: torch.Tensor) -> str:
    """``"int_mm"`` where ``torch._int_mm`` handles the call, else ``"reference"`` (exact int32 / fp64 dot)."""
    n, k = qweight.shape
    m = x.numel() // max(k, 1)
    return "int_mm" if x.device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0 else "reference"
