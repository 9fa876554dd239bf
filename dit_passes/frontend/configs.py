"""cache-dit 1.5.3's ``ParallelismConfig`` and ``QuantizeConfig``: same field names and defaults, mapped onto passes.

``ParallelismConfig.to_passes()`` gives the context-parallel / tensor-parallel passes for the current process
group; ``QuantizeConfig.to_passes(model)`` gives the quantization passes. What the reference accepts but these
passes do not implement raises ``NotImplementedError`` naming the field (never a silent fallback); fields that
only tune the reference's own kernels, and change nothing here, are accepted with a ``warnings.warn`` naming them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..passes.quantize import Fp8Linear, Int4WeightOnly, Int8Linear, NVFP4WeightOnly, SVDQuantW4A4
from ..passes.quantize_few_shot import SVDQuantFewShot
from .attention_names import attention_pass
from .svdq_kwargs import SMOOTH, smooth_strategy, svdq_options

logger = logging.getLogger("dit_passes")


def _size(name: str, v: Any) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ParallelismConfig.{name}={v!r}: use None or an int >= 1 (number of ranks)")
    return v


@dataclasses.dataclass
class ParallelismConfig:
    """Reference field order and defaults. Sizes ``None`` / 1 everywhere is a no-op (logged), not an error.

    Mapped: ``ulysses_size`` -> ``passes.Ulysses``, ``ring_size`` -> ``passes.Ring``, both -> ``passes.USP``,
    ``tp_size`` -> ``passes.TensorParallel``, on the current (torchrun-initialised) process group; ``use_ray``
    -> :class:`~dit_passes.launch.ray_launcher.RayLauncher` (built by ``dit_passes.frontend.api``): ``ray_address``
    -> its ``address`` (``ray.init(address=...)`` when Ray is not initialised here), ``ray_worker_options`` -> its
    ``worker_options`` (the actors' ``.options(...)``), ``ray_runtime_env`` / ``ray_init_kwargs`` as named.
    Uneven sequence lengths are always exact here, so ``ulysses_anything`` needs nothing; the ring exchange
    is point-to-point (``ring_rotate_method="p2p"``) or one all-gather of K / V (``"allgather"``: the same
    result) and merges partial results in fp32 (``ring_convert_to_fp32=False`` warns: cache-dit 1.5.3's fused merge
    ignores it too). ``cp_plan`` warns (the plan is derived from the graph; any exact plan gives that output);
    ``attention_backend``: ``"native"`` (SDPA's choice) or a pinned SDPA kernel (``"_native_cudnn"``,
    ``"_native_flash"``, ``"_native_efficient"``, ``"_native_math"``, cache-dit's ``"_sdpa_cudnn"``) appends
    ``passes.AttentionBackend`` (:mod:`~dit_passes.frontend.attention_names`); other packages' kernels (flash-attn,
    sage, ...) are refused. ``parallel_kwargs`` (deprecated there too) sets the fields it names,
    ``experimental_ulysses_*`` the ``ulysses_*`` ones, and refuses other keys; ``extra_parallel_kwargs`` warns
    (cache-dit 1.5.3 reads none of its keys). ``ray_auto_shutdown=False`` leaves the Ray this front end started
    running after ``disable_cache`` (the workers stop either way); ``ray_master_port`` warns (rank 0 picks a free
    port). ``backend``: cache-dit's names, refused where its sizes need another. CP together with TP builds both on
    one mesh
    (:func:`~dit_passes.passes.parallel_plan.parallel_passes`). ``extra_parallel_modules`` (text encoders: TE-P,
    a VAE: VAE-P, a ControlNet: CN-P) are parallelised where the transformer runs: this process, or with
    ``use_ray`` the workers (the pipeline gets a proxy of each); given as modules or as names (``"text_encoder"``:
    the main encoder, :func:`~dit_passes.frontend.components.extra_modules`). With ``ray_transfer_fn`` each worker
    builds its pipeline and resolves the names there (modules of this process are refused: they name nothing there).
    ``ulysses_float8=True`` sends the Ulysses all-to-alls as e4m3 rows with per-row scales (approximate);
    ``ulysses_async=True`` issues each q / k / v all-to-all as soon as it is projected and waits for it after the
    next projection (``passes.Ulysses(size, async_qkv=True)``, with a ring ``passes.USP(..., ulysses_async=True)``:
    the bits of the synchronous form, float8 included); it needs ``ulysses_size > 1``.
    """

    backend: Any = "auto"
    ulysses_size: Optional[int] = None
    ring_size: Optional[int] = None
    tp_size: Optional[int] = None
    use_ray: bool = False
    ray_num_workers: Optional[int] = None
    ray_address: Optional[str] = None
    ray_runtime_env: Optional[Dict[str, Any]] = None
    ray_init_kwargs: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"include_dashboard": False})
    ray_worker_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    ray_master_port: int = 0
    ray_auto_shutdown: bool = True
    ray_transfer_backend: str = "auto"
    ray_transfer_custom_obj: bool = True
    ray_use_flashpack: bool = False
    ray_use_compile: bool = False
    ray_transfer_fn: Optional[Callable[[], Any]] = None
    cp_plan: Optional[Any] = None
    attention_backend: Optional[str] = None
    ulysses_anything: Optional[bool] = False
    ulysses_float8: Optional[bool] = False
    ulysses_async: Optional[bool] = False
    extra_parallel_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    ring_rotate_method: Optional[str] = "p2p"
    ring_convert_to_fp32: Optional[bool] = True
    extra_parallel_modules: Optional[List[Any]] = dataclasses.field(default_factory=list)
    parallel_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._flatten_parallel_kwargs()
        for name in ("ulysses_size", "ring_size", "tp_size", "ray_num_workers"):
            _size(name, getattr(self, name))
        self._check_backend()
        if not isinstance(self.extra_parallel_kwargs, dict):
            raise TypeError(f"ParallelismConfig.extra_parallel_kwargs must be a dict, got "
                            f"{type(self.extra_parallel_kwargs).__name__}")
        if self.extra_parallel_kwargs:  # the reference hands them to its model-specific planners; 1.5.3's read none
            warnings.warn(f"ParallelismConfig.extra_parallel_kwargs {sorted(self.extra_parallel_kwargs)}: no key has "
                          "an effect (cache-dit 1.5.3 passes them to its model-specific context-parallel plans, none "
                          "of which reads one; dit_passes derives the plan from the graph); for the Ulysses / ring "
                          f"options use the ParallelismConfig fields {list(PARALLEL_KWARGS)}", stacklevel=3)
        if self.cp_plan is not None:
            warnings.warn("ParallelismConfig.cp_plan is not used: dit_passes derives where the sequence is split and "
                          "gathered from the traced graph (passes.Ulysses / Ring), which gives the output of any exact "
                          "plan; drop cp_plan", stacklevel=3)
        if not isinstance(self.ray_auto_shutdown, bool):
            raise TypeError(f"ParallelismConfig.ray_auto_shutdown must be a bool, got {self.ray_auto_shutdown!r}")
        attention_pass(self.attention_backend)  # a name the reference takes but dit_passes has no kernel for: refused
        if self.ring_convert_to_fp32 is False:
            warnings.warn("ParallelismConfig.ring_convert_to_fp32=False has no effect: ring attention merges its "
                          "partial results in fp32 here, as cache-dit 1.5.3 does whatever this flag says (its fused "
                          "merge kernel); drop it", stacklevel=3)
        if not isinstance(self.use_ray, bool):
            raise TypeError(f"ParallelismConfig.use_ray must be a bool, got {self.use_ray!r}")
        if self.ray_transfer_fn is not None and not callable(self.ray_transfer_fn):
            raise TypeError("ParallelismConfig.ray_transfer_fn must be a zero-argument callable returning the pipeline")

    # -- what is asked for ------------------------------------------------------------------------
    def sizes(self) -> Tuple[int, int, int]:
        """``(ulysses, ring, tp)``, ``None`` read as 1."""
        return self.ulysses_size or 1, self.ring_size or 1, self.tp_size or 1

    def world_size(self) -> int:
        u, r, t = self.sizes()
        return u * r * t

    def is_noop(self) -> bool:
        return self.world_size() == 1 and not self.use_ray and not self.extra_parallel_modules

    def check_supported(self) -> None:
        if self.ulysses_async and (self.ulysses_size or 1) < 2:
            raise ValueError("ParallelismConfig.ulysses_async=True overlaps the Ulysses all-to-alls: it needs "
                             f"ulysses_size > 1 (got ulysses_size={self.ulysses_size}, ring_size={self.ring_size})")
        if self.ring_rotate_method not in (None, "p2p", "allgather"):
            raise ValueError(f"ParallelismConfig.ring_rotate_method={self.ring_rotate_method!r}: use 'p2p' "
                             "(ring exchanges) or 'allgather' (one all-gather of K / V per attention)")

    def _check_backend(self) -> None:
        """``backend`` as the reference checks it: one of its names (or its enum), and, where a size is > 1, the one
        it would pick for these sizes (CP: cache_dit / native_diffuser, TP: native_pytorch, both: native_hybrid)."""
        value = getattr(self.backend, "value", self.backend)
        name = PARALLEL_BACKENDS.get(value.lower()) if isinstance(value, str) else None
        if name is None or name == "none":
            raise ValueError(f"ParallelismConfig.backend={self.backend!r} is not a parallelism backend; use one of "
                             f"{sorted(k for k, v in PARALLEL_BACKENDS.items() if v != 'none')} ('auto' picks the one "
                             "of the sizes)")
        u, r, t = self.sizes()
        cp, tp = u * r > 1, t > 1
        need = "native_hybrid" if cp and tp else "cache_dit" if cp else "native_pytorch" if tp else None
        if name != "auto" and need is not None and name != need:
            raise ValueError(f"ParallelismConfig.backend={self.backend!r} does not run {self.strify()}: it needs "
                             f"backend={need!r} (or 'auto'), as in cache-dit")

    def _flatten_parallel_kwargs(self) -> None:
        """The reference's deprecated ``parallel_kwargs``: each key naming a field sets it (over the field's own
        value, as there), ``experimental_ulysses_*`` the ``ulysses_*`` fields; any other key is refused."""
        kw = self.parallel_kwargs
        if not kw:
            return
        if not isinstance(kw, dict):
            raise TypeError(f"ParallelismConfig.parallel_kwargs must be a dict, got {type(kw).__name__}")
        fields = [f.name for f in dataclasses.fields(self) if f.name != "parallel_kwargs"]
        unknown = sorted(k for k in kw if k not in fields and k not in PARALLEL_KWARGS_DEPRECATED)
        if unknown:
            raise ValueError(f"ParallelismConfig.parallel_kwargs: unknown key(s) {unknown}; it takes ParallelismConfig "
                             f"fields (e.g. {list(PARALLEL_KWARGS)}) and {list(PARALLEL_KWARGS_DEPRECATED)}; better, "
                             "set the fields themselves")
        for key, value in kw.items():
            field = PARALLEL_KWARGS_DEPRECATED.get(key, key)
            setattr(self, field, value)
        warnings.warn(f"ParallelismConfig.parallel_kwargs is deprecated (as in cache-dit): {sorted(kw)} set the fields "
                      f"{sorted({PARALLEL_KWARGS_DEPRECATED.get(k, k) for k in kw})}; set those fields instead",
                      FutureWarning, stacklevel=4)

    def to_passes(self) -> list:
        """The parallel passes for the current process group (empty when every size is 1), then
        :class:`~dit_passes.passes.AttentionBackend` for ``attention_backend`` when it names a pinned SDPA kernel.
        CP x TP builds the subgroups of a (cp, tp) mesh: a collective, every rank must call it."""
        from ..passes.parallel_plan import parallel_passes
        self.check_supported()
        passes = parallel_passes(*self.sizes(), ring_rotate_method=self.ring_rotate_method or "p2p",
                                 ulysses_float8=bool(self.ulysses_float8), ulysses_async=bool(self.ulysses_async))
        attention = attention_pass(self.attention_backend)
        if attention is not None and self.sizes()[0] * self.sizes()[1] > 1:
            warnings.warn(f"ParallelismConfig.attention_backend={self.attention_backend!r} pins the SDPA kernel of the "
                          "attentions left as aten ops; the Ulysses / ring attentions keep SDPA's own choice (the same "
                          "attention, rounding apart)", stacklevel=2)
        return passes + ([attention] if attention is not None else [])

    def ray_transfer(self) -> Optional[str]:
        """RayLauncher's ``transfer=`` for ``ray_transfer_backend`` (None: its default)."""
        b = self.ray_transfer_backend
        if b in (None, "auto"):
            return None
        if b in ("object_store", "snapshot"):
            return b
        raise ValueError(f"ParallelismConfig.ray_transfer_backend={b!r}: use 'auto', 'object_store' or 'snapshot' "
                         "(or ray_transfer_fn=...)")

    def strify(self, details: bool = False) -> str:
        """The reference's tags: ``Ulysses2_Ring2``, ``TP2``; ``details=True``: ``ParallelismConfig(...)``."""
        if details:
            parts = [f"backend={self.backend}"] + [f"{n}={getattr(self, n)}" for n in
                                                   ("ulysses_size", "ring_size", "tp_size")
                                                   if getattr(self, n) is not None]
            return "ParallelismConfig(" + ", ".join(parts) + ")"
        parts = []
        if self.ulysses_size is not None:
            parts.append(f"Ulysses{self.ulysses_size}")
        if self.ring_size is not None:
            parts.append(f"Ring{self.ring_size}")
        if self.ulysses_anything:
            parts.append("UAA")
        if self.tp_size is not None:
            parts.append(f"TP{self.tp_size}")
        return "_".join(parts)


# cache-dit's ParallelismBackend names and values (case-insensitive) -> the canonical one (native_diffuser: cache_dit)
PARALLEL_BACKENDS = {"auto": "auto", "cache_dit": "cache_dit", "native_diffuser": "cache_dit",
                     "native_pytorch": "native_pytorch", "native_hybrid": "native_hybrid", "none": "none"}
# the reference's parallel_kwargs keys that name the Ulysses / ring fields, and its deprecated spellings of three
PARALLEL_KWARGS = ("ulysses_anything", "ulysses_float8", "ulysses_async", "ring_rotate_method", "ring_convert_to_fp32")
PARALLEL_KWARGS_DEPRECATED = {"experimental_ulysses_anything": "ulysses_anything",
                              "experimental_ulysses_float8": "ulysses_float8",
                              "experimental_ulysses_async": "ulysses_async"}


# ----------------------------------------------------------------------------------------- quantize
SUPPORTED_QUANT_TYPES = ("float8_per_row", "float8_per_tensor", "float8_per_block", "float8_weight_only",
                         "int8_per_row", "int8_per_tensor", "int8_weight_only", "int4_weight_only", "nvfp4",
                         "nvfp4_weight_only", "svdq_int4_r{rank}", "svdq_int4_r{rank}_dq", "svdq_nvfp4_r{rank}",
                         "svdq_nvfp4_r{rank}_dq")
_SVDQ = re.compile(r"^svdq_(int4|nvfp4)_r(\d+)(_dq)?$")
# the reference's torchao types -> (kind, Fp8Linear / Int8Linear arguments)
_BASIC = {"float8_per_row": ("fp8", {"granularity": "per_row"}),
          "float8_per_tensor": ("fp8", {"granularity": "per_tensor"}),
          "float8_per_block": ("fp8", {"granularity": "per_block"}),
          "float8_weight_only": ("fp8", {"granularity": "per_row", "weight_only": True}),
          "int8_per_row": ("int8", {"granularity": "per_row"}),
          "int8_per_tensor": ("int8", {"granularity": "per_tensor"}),
          "int8_weight_only": ("int8", {"granularity": "per_row", "weight_only": True}),
          "int4_weight_only": ("int4", {}),
          # torchao's NVFP4 (e2m1 weights and per-call activations, e4m3 scales per 16, an fp32 global scale):
          # SVDQuant's NVFP4 arithmetic without its smoothing or low-rank branch, every selected linear alike
          "nvfp4": ("nvfp4", {"rank": 0, "dynamic": True, "smooth": "none", "precision": "nvfp4",
                              "modulation": "svdq"}),
          "nvfp4_weight_only": ("nvfp4_wo", {})}


def parse_quant_type(quant_type: str) -> Tuple[str, Dict[str, Any]]:
    """``(kind, args)``: kind in {"fp8", "int8", "int4", "nvfp4", "nvfp4_wo", "svdq"}; raises ``ValueError`` listing
    the supported types."""
    qt = quant_type.lower() if isinstance(quant_type, str) else quant_type
    if qt in _BASIC:
        kind, args = _BASIC[qt]
        return kind, dict(args)
    m = _SVDQ.match(qt) if isinstance(qt, str) else None
    if m and int(m.group(2)) > 0:
        return "svdq", {"rank": int(m.group(2)), "dynamic": m.group(3) is not None, "precision": m.group(1)}
    raise ValueError(f"QuantizeConfig.quant_type={quant_type!r} is not supported; supported: "
                     f"{list(SUPPORTED_QUANT_TYPES)} (rank a positive int, e.g. 'svdq_int4_r32_dq')")


@dataclasses.dataclass
class QuantizeConfig:
    """Reference field order and defaults; ``quant_type`` is checked when the config is built.

    The torchao types map onto :class:`Fp8Linear` / :class:`Int8Linear`: ``float8_per_row`` / ``float8_per_tensor``
    (e4m3 weights and per-token / per-tensor dynamic activations), ``float8_per_block`` (weight tiles of 128 x 128,
    activations per token and 128 features; linears whose N or K is not a multiple of 128 stay unquantized, as in the
    reference), ``float8_weight_only`` (e4m3 weights per row dequantized at run time, activations unquantized),
    ``int8_per_row`` / ``int8_per_tensor`` (symmetric int8, int32 accumulation), ``int8_weight_only`` (W8A16: int8
    weights per row, activations unquantized), ``int4_weight_only`` (:class:`Int4WeightOnly`: int4 weights per group
    of 64 with a bf16 scale, activations unquantized), ``nvfp4`` (SVDQuant's NVFP4 W4A4 arithmetic at rank 0, no
    smoothing: the reference path on CPU, fp8 tensor cores on sm_89+), ``nvfp4_weight_only`` (:class:`NVFP4WeightOnly`:
    NVFP4 weights, activations unquantized, any device).

    ``exclude_layers``: substrings of module paths (or dit_passes role names such as ``"modulation"``);
    ignored when ``filter_fn(module, name) -> bool`` is given (reference rule). Its default is cache-dit's, which
    keeps the AdaLN modulation linears unquantized; without ``"modulation"`` / ``"mod"`` in it they are quantized
    too (SVDQ: weight-only int4 + a low-rank branch, ``SVDQuantW4A4(modulation="w4a16_lr")``; fp8 / int8: their own
    form); a mixture of experts' router (role ``router``) stays unquantized either way. Which linears:
    ``regional_quantize=True`` (default) those inside the module's ``_repeated_blocks`` classes, else inside
    ``repeated_blocks``, else every linear (the reference's rule, :meth:`region`); ``regional_quantize=False`` every
    linear. ``precision_plan={layer-name substring: quant type}`` (any torchao type above) gives
    those linears their own type, the rest ``quant_type`` (:meth:`to_passes`). ``svdq_nvfp4_*``: the same with NVFP4 in
    place of int4 (checkpoints in the NVFP4 layout; the reference on CPU, fp8 tensor cores on sm_89+). SVDQ PTQ
    (``svdq_int4_r{rank}``, ``svdq_nvfp4_r{rank}``) needs
    ``calibrate_fn`` (it runs the pipeline holding the original transformer; called as the reference calls it, with
    those of ``model=``, ``quantize_config=``, ``component_name=``, ``svdq_kwargs=`` it names: see
    :func:`~dit_passes.frontend.calibration.call_calibrate_fn`) and
    ``serialize_to`` (a directory, or ``<dir>/<quant_type>.safetensors``). ``svdq_kwargs``: ``smooth_strategy``
    ("activation" for PTQ; "identity" (default), "weight", "weight_inv" or "few_shot" for ``_dq``),
    ``calibrate_precision`` and ``svd_refine_iters`` (``SVDQuantW4A4(svd_precision=, refine_iters=)``); the keys
    that only tune the reference's calibration memory, kernels and compile scheduling are accepted with a warning
    naming them (:mod:`~dit_passes.frontend.svdq_kwargs`). ``"few_shot"`` (:class:`~dit_passes.passes.quantize_few_shot.
    SVDQuantFewShot`): the transformer runs unquantized for the first ``few_shot_steps`` forwards (default 1; every
    call of the transformer counts, cumulatively over pipeline runs, as in the reference) while each selected
    linear's input abs-max is recorded; then each linear's smoothing comes from that span, relaxed channel by
    channel (``few_shot_relax_strategy`` "auto" (default), "fixed", "top" (alias "top_q4"), "stable_auto", "power",
    "log", "rank"; ``few_shot_relax_factor`` 1.5 the largest multiplier, ``few_shot_relax_top_ratio`` 0.25 the share
    of channels saturating it), and its weight; the quantized linears are built once and run from the next forward
    on; a linear that never ran stays unquantized (:mod:`~dit_passes.quant.few_shot`).
    ``components_to_quantize`` (a list of pipeline component names or modules, or ``{name: {field: value}}``):
    those components only, each with its config
    (:meth:`component_configs`); ``"text_encoder"`` names the pipeline's main text encoder as the reference picks
    it (:func:`~dit_passes.frontend.components.main_text_encoder`); other components than the transformer(s)
    quantize every linear but ``exclude_layers`` (float8 / int8 types; see :mod:`~dit_passes.frontend.components`),
    with ``use_ray`` where they run (the workers for an extra parallel module, else this process).
    ``backend``: cache-dit's names ("auto", "torchao" / "ao", "cache_dit"; :func:`quant_backend`), refused where the
    reference would not run the quant type on it. ``per_tensor_fallback``: with tensor parallelism and
    ``float8_per_row``, the row-parallel linears take fp8 per tensor (True) or stay unquantized (False), as the
    reference does (:meth:`row_parallel_form`); SVDQuant refuses False, as the reference. ``verbose=True``: each
    quantize pass prints, per linear, the kind it became or why it was left (the pass's ``verbose``).
    """

    backend: Any = "auto"
    quant_type: str = "float8_per_row"
    exclude_layers: Optional[List[str]] = dataclasses.field(
        default_factory=lambda: ["embedder", "embed", "modulation", "mod"])
    regional_quantize: bool = True
    repeated_blocks: List[str] = dataclasses.field(default_factory=list)
    filter_fn: Optional[Callable[[Any, str], bool]] = None
    components_to_quantize: Optional[Any] = None
    per_tensor_fallback: bool = True
    precision_plan: Optional[Dict[str, str]] = None
    calibrate_fn: Optional[Callable[..., Any]] = None
    serialize_to: Optional[str] = None
    svdq_kwargs: Optional[Dict[str, Any]] = None
    verbose: bool = False

    def __post_init__(self) -> None:
        self.kind, self.args = parse_quant_type(self.quant_type)
        self.quant_type = self.quant_type.lower()
        self.backend = quant_backend(self.backend, self.quant_type, self.kind)
        if not isinstance(self.verbose, bool):
            raise TypeError(f"QuantizeConfig.verbose must be a bool, got {self.verbose!r}")
        if not isinstance(self.per_tensor_fallback, bool):
            raise TypeError(f"QuantizeConfig.per_tensor_fallback must be a bool, got {self.per_tensor_fallback!r}")
        if self.kind == "svdq" and self.per_tensor_fallback is not True:
            raise ValueError(f"QuantizeConfig.per_tensor_fallback=False with {self.quant_type}: it chooses the fp8 "
                             "form of tensor-parallel row-parallel linears, SVDQuant has none (cache-dit refuses it "
                             "too); leave it True")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise TypeError("QuantizeConfig.filter_fn must be callable(module, name) -> bool")
        if self.svdq_kwargs is not None and self.kind != "svdq":
            raise ValueError("QuantizeConfig.svdq_kwargs is only valid when quant_type starts with 'svdq'")
        strategy = None
        if self.kind == "svdq":
            dynamic = self.args["dynamic"]
            strategy = smooth_strategy(self.svdq_kwargs or {}, dynamic, self.quant_type)
            self.args["smooth"], self.smooth_strategy = SMOOTH[strategy], strategy
        self.svdq_options, self.few_shot = svdq_options(self.svdq_kwargs or {}, strategy)
        if self.kind == "svdq" and self.args["precision"] == "nvfp4" and (self.svdq_kwargs or {}).get(
                "runtime_kernel") == "v2":
            raise ValueError(f"{self.quant_type}: svdq_kwargs['runtime_kernel']='v2' is refused, as cache-dit refuses "
                             "it for SVDQ NVFP4 (its v1 kernel only); drop the key")
        if self.kind == "svdq":
            if dynamic and self.calibrate_fn is not None:
                raise ValueError("calibrate_fn is not used by SVDQuant dynamic quantization (_dq): drop it")
            if not dynamic and (self.calibrate_fn is None or self.serialize_to is None):
                raise ValueError(f"{self.quant_type} (SVDQuant PTQ) needs calibrate_fn (runs the pipeline on a few "
                                 "prompts) and serialize_to (a directory); or use the '_dq' variant")
        if self.serialize_to is not None:  # the reference's rule: a directory, or <dir>/<quant_type>.safetensors
            path = os.fspath(self.serialize_to)
            if path.endswith(".safetensors") and (os.path.basename(path) != f"{self.quant_type}.safetensors"
                                                  or not os.path.dirname(path)):
                raise ValueError(f"QuantizeConfig.serialize_to={path!r}: give a directory (the checkpoint is written "
                                 f"as <dir>/{self.quant_type}.safetensors) or a file path <dir>/"
                                 f"{self.quant_type}.safetensors")
        if self.kind != "svdq" and self.calibrate_fn is not None:
            warnings.warn(f"QuantizeConfig.calibrate_fn is used by SVDQuant PTQ only (as in cache-dit); it has no "
                          f"effect with quant_type={self.quant_type!r}: drop it", stacklevel=3)

    def is_ptq(self) -> bool:
        """SVDQuant post-training quantization: needs calibration (``calibrate``) before the pass is built."""
        return self.kind == "svdq" and not self.args["dynamic"]

    def check_supported(self) -> None:
        plan = self.precision_plan
        if plan is not None:
            if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
                raise TypeError(f"QuantizeConfig.precision_plan must map layer-name substrings to quant types, got "
                                f"{plan!r}")
            bad = sorted({v for v in plan.values() if v.lower() not in PLAN_QUANT_TYPES})
            if bad:
                raise NotImplementedError(f"QuantizeConfig.precision_plan quant types {bad}: a plan takes "
                                          f"{list(PLAN_QUANT_TYPES)} (the reference's torchao types dit_passes has)")
        if self.repeated_blocks is not None and not (isinstance(self.repeated_blocks, (list, tuple)) and all(
                isinstance(c, str) and c for c in self.repeated_blocks)):
            raise TypeError(f"QuantizeConfig.repeated_blocks must be a list of block class names, got "
                            f"{self.repeated_blocks!r}")
        self.component_configs()  # checks components_to_quantize

    def component_configs(self) -> List[Tuple[Any, "QuantizeConfig"]]:
        """``(component, config)`` per entry of ``components_to_quantize`` (the reference's ``expand_configs``): a
        list names components (pipeline attribute names, or the modules themselves) quantized to this config; a
        dict ``{name: {field: value}}`` gives each its own fields (``quant_type``, ``exclude_layers``, ...), the rest
        from this config. ``None``: ``[("transformer", self)]``. SVDQuant types take the transformer(s) only (the
        reference refuses ``components_to_quantize`` with them)."""
        comps = self.components_to_quantize
        if comps is None:
            return [("transformer", self)]
        if isinstance(comps, dict):
            entries = list(comps.items())
        elif isinstance(comps, (list, tuple)):
            entries = [(c, {}) for c in comps]
        else:
            raise TypeError(f"QuantizeConfig.components_to_quantize must be a list of component names (or modules) or "
                            f"a dict {{name: {{field: value}}}}, got {type(comps).__name__}")
        fields = {f.name for f in dataclasses.fields(self)} - {"components_to_quantize"}
        out = []
        for component, overrides in entries:
            if not (isinstance(component, str) and component) and not callable(getattr(component, "forward", None)):
                raise TypeError(f"QuantizeConfig.components_to_quantize: {component!r} is neither a component name "
                                "nor a module")
            if not isinstance(overrides, dict) or set(overrides) - fields:
                raise ValueError(f"QuantizeConfig.components_to_quantize[{component!r}] must be a dict of "
                                 f"QuantizeConfig fields, got {overrides!r}")
            config = dataclasses.replace(self, components_to_quantize=[component], **overrides)
            if config.kind == "svdq" and component not in ("transformer", "transformer_2"):
                raise ValueError(f"QuantizeConfig.components_to_quantize: {component!r} with {config.quant_type}: "
                                 "SVDQuant quantizes the transformer(s) only (as the reference); give that component "
                                 "a float8 / int8 quant_type ({name: {'quant_type': ...}})")
            out.append((component, config))
        return out

    def region(self, model: Any = None) -> Dict[str, Any]:
        """Which linears, as the reference decides: ``regional_quantize=False`` every linear of the module; else those
        inside the module's ``_repeated_blocks`` classes (diffusers' attribute, which wins), else inside
        ``repeated_blocks``; with neither, every linear (the reference then turns regional quantization off). Without
        the module (Ray workers rebuild it) and no ``repeated_blocks``: the blocks discovered in the graph."""
        if not self.regional_quantize:
            return {"regional": False}
        classes = getattr(model, "_repeated_blocks", None) if model is not None else None
        classes = classes or self.repeated_blocks or None
        if classes:
            return {"block_classes": tuple(classes)}
        return {} if model is None else {"regional": False}

    def serialize_dir(self) -> Optional[str]:
        if self.serialize_to is None:
            return None
        path = os.fspath(self.serialize_to)
        return os.path.dirname(path) if path.endswith(".safetensors") else path

    def row_parallel_form(self, tp_size: int = 1) -> Optional[str]:
        """What the reference does to the row-parallel linears of tensor parallelism (``tp_size > 1``) under
        ``float8_per_row``: ``"per_tensor"`` (``per_tensor_fallback=True``: fp8 with one scale per tensor, its
        fallback), ``"skip"`` (False: left unquantized); None where it does nothing (no TP, another quant type, or
        ``regional_quantize=False``, where its fallback does not run)."""
        if tp_size <= 1 or self.quant_type != "float8_per_row":
            return None
        if self.per_tensor_fallback:
            return "per_tensor" if self.regional_quantize else None
        return "skip"

    def to_passes(self, model: Any = None, calibrated: Optional[Dict[str, Any]] = None, tp_size: int = 1) -> List[Any]:
        """The quantization passes: :meth:`to_pass` for the linears no ``precision_plan`` entry names, then one pass
        per quant type of the plan (the reference's order; each takes the linears whose path contains one of its
        layer names and no earlier plan type took). The reference runs the plan first; the partition is the same,
        and this order keeps the default pass's role analysis (the AdaLN ``modulation`` linears it excludes) on the
        graph before any plan pass rewrote it. ``tp_size``: the tensor-parallel size the passes run after;
        ``float8_per_row`` then treats the row-parallel linears (roles ``attn_out`` / ``mlp_down`` / ``proj`` in the
        blocks) as :meth:`row_parallel_form` says."""
        self.check_supported()
        by_type: Dict[str, List[str]] = {}
        for name, qt in (self.precision_plan or {}).items():
            by_type.setdefault(qt.lower(), []).append(name)
        planned = tuple(n for names in by_type.values() for n in names)
        skip = _PlanFilter(planned, inverted=True) if planned else None
        row_form = self.row_parallel_form(tp_size)
        if row_form is not None:  # the row-parallel linears leave the per-row pass
            not_row = _RoleFilter(ROW_PARALLEL_ROLES, inverted=True)
            skip = not_row if skip is None else _Both(skip, not_row)
        out = [self.to_pass(model, calibrated, skip=skip)]
        if row_form == "per_tensor":
            rows = _RoleFilter(ROW_PARALLEL_ROLES)
            kind, args = parse_quant_type("float8_per_tensor")
            common = self._common(model, rows if not planned else _Both(rows, _PlanFilter(planned, inverted=True)))
            out.append(_basic_pass(kind, args, dict(common, serialize_to=None)))
        for qt in PLAN_QUANT_TYPES:
            if qt in by_type:
                kind, args = parse_quant_type(qt)
                out.append(_basic_pass(kind, args, dict(self._common(model, _PlanFilter(tuple(by_type[qt]))),
                                                        serialize_to=None)))
        return out

    def _common(self, model: Any, plan: Optional[Callable[[str, str], bool]] = None) -> Dict[str, Any]:
        user_fn = self.filter_fn
        # a mixture of experts' router stays in precision unless a filter_fn of the user's decides (its rounding
        # would change which experts run: dit_passes.passes.quantize_select.DEFAULT_EXCLUDE)
        exclude = () if user_fn is not None else (*tuple(self.exclude_layers or ()), "router")
        filter_fn = None
        if user_fn is not None:
            if model is None:
                raise NotImplementedError("QuantizeConfig.filter_fn needs the transformer object (filter_fn(module, "
                                          "name)): pass it (to_passes(model))")
            filter_fn = _ModuleFilter(user_fn, model)
        if plan is not None:
            filter_fn = plan if filter_fn is None else _Both(plan, filter_fn)
        return dict(exclude=exclude, filter_fn=filter_fn, serialize_to=self.serialize_dir(), verbose=self.verbose,
                    **self.region(model))

    def to_pass(self, model: Any = None, calibrated: Optional[Dict[str, Any]] = None,
                skip: Optional[Callable[[str, str], bool]] = None):
        """The quantization pass of ``quant_type``. ``model``: the original transformer (for ``filter_fn``'s module
        argument and its ``_repeated_blocks``); ``calibrated``: activation abs-max per linear path, from
        :func:`calibrate` (SVDQ PTQ); ``skip``: a further ``(path, role) -> bool`` the linears must pass."""
        self.check_supported()
        common = self._common(model, skip)
        if self.kind != "svdq":
            return _basic_pass(self.kind, self.args, common)
        a = self.args
        if a["dynamic"] and a["smooth"] == "few_shot":
            return SVDQuantFewShot(rank=a["rank"], precision=a["precision"], **self.few_shot, **self.svdq_options,
                                   **common)
        if a["dynamic"]:
            return SVDQuantW4A4(rank=a["rank"], dynamic=True, smooth=a["smooth"], precision=a["precision"],
                                **self.svdq_options, **common)
        if calibrated is None:
            raise ValueError(f"{self.quant_type}: run calibrate(config, model) first (SVDQuant PTQ)")
        return Precalibrated(calibrated, rank=a["rank"], calibrate_fn=self.calibrate_fn, precision=a["precision"],
                             **self.svdq_options, **common)

    def strify(self) -> str:
        """The reference's tag: the quant type, ``_dq`` types with their smooth strategy unless identity."""
        qt = self.quant_type
        if self.kind == "svdq" and self.args["dynamic"] and self.args["smooth"] != "none":
            qt += f"_{self.smooth_strategy}"
            if self.smooth_strategy == "few_shot":
                qt += f"_{self.few_shot['relax_strategy']}"
        return qt


# the reference's plan order (its _PREFERRED_PRECISION_PLAN_ORDER, the types dit_passes has)
PLAN_QUANT_TYPES = ("float8_per_tensor", "float8_per_row", "float8_per_block", "float8_weight_only", "nvfp4",
                    "nvfp4_weight_only", "int8_per_tensor", "int8_per_row", "int8_weight_only", "int4_weight_only")


# cache-dit's QuantizeBackend names (case-insensitive) -> the canonical one kept in QuantizeConfig.backend
QUANT_BACKENDS = {"auto": "auto", "ao": "torchao", "torchao": "torchao", "cache_dit": "cache_dit",
                  "cache-dit": "cache_dit", "cachedit": "cache_dit"}


def quant_backend(backend: Any, quant_type: str, kind: str) -> str:
    """``backend`` checked as the reference checks it: one of its names (or its enum), and the one that runs
    ``quant_type`` there (torchao: the torchao types; cache_dit: SVDQuant's); the passes of dit_passes run either."""
    value = getattr(backend, "value", backend)
    name = QUANT_BACKENDS.get(value.lower()) if isinstance(value, str) else None
    if name is None:
        raise ValueError(f"QuantizeConfig.backend={backend!r} is not a quantization backend; use one of "
                         f"{sorted(QUANT_BACKENDS)} (cache-dit's names; 'auto' picks the one of the quant type)")
    if name == "torchao" and kind == "svdq":
        raise ValueError(f"QuantizeConfig.backend={backend!r} runs torchao's types; {quant_type} is SVDQuant, "
                         "cache-dit's own backend: use backend='auto' or 'cache_dit'")
    if name == "cache_dit" and kind != "svdq":
        raise ValueError(f"QuantizeConfig.backend={backend!r} runs SVDQuant (svdq_* types) only; {quant_type} is a "
                         "torchao type: use backend='auto' or 'torchao'")
    return name


def _basic_pass(kind: str, args: Dict[str, Any], common: Dict[str, Any]):
    passes = {"fp8": Fp8Linear, "int8": Int8Linear, "int4": Int4WeightOnly, "nvfp4": SVDQuantW4A4,
              "nvfp4_wo": NVFP4WeightOnly}
    return passes[kind](**args, **common)


# the linears tensor parallelism makes row-parallel (analysis.structure: Structure.row_parallel_linears)
ROW_PARALLEL_ROLES = ("attn_out", "mlp_down", "proj")


class _RoleFilter:
    """The linears of ``roles`` (``inverted``: the others)."""

    def __init__(self, roles: Tuple[str, ...], inverted: bool = False):
        self.roles, self.inverted = roles, inverted

    def __call__(self, path: str, role: str) -> bool:
        return (role in self.roles) != self.inverted


class _PlanFilter:
    """A precision-plan entry's linears: those whose module path contains one of ``names`` (the reference's rule);
    ``inverted``: the others."""

    def __init__(self, names: Tuple[str, ...], inverted: bool = False):
        self.names, self.inverted = names, inverted

    def __call__(self, path: str, role: str) -> bool:
        return any(n in path for n in self.names) != self.inverted


class _Both:
    def __init__(self, *fns: Callable[[str, str], bool]):
        self.fns = fns

    def __call__(self, path: str, role: str) -> bool:
        return all(f(path, role) for f in self.fns)


class _ModuleFilter:
    """dit_passes' ``filter_fn(path, role)`` from the reference's ``filter_fn(module, name)``."""

    def __init__(self, fn: Callable[[Any, str], bool], model: Any):
        self.fn, self.model = fn, model

    def __call__(self, path: str, role: str) -> bool:
        return bool(self.fn(self.model.get_submodule(path), path))


class Precalibrated(SVDQuantW4A4):
    """SVDQuantW4A4 PTQ whose activation statistics were collected before the module was wrapped (the
    reference's flow: ``calibrate_fn`` runs the pipeline while it still holds the original transformer)."""

    def __init__(self, stats: Dict[str, Any], **kw: Any):
        super().__init__(**kw)
        self.stats = stats

    def calibrate(self, weights):
        return {p: self.stats[p] for p in weights if p in self.stats}


__all__ = ["ParallelismConfig", "QuantizeConfig", "SUPPORTED_QUANT_TYPES", "parse_quant_type", "calibrate"]

from .calibration import calibrate  # noqa: E402  (re-exported: the PTQ calibration lives apart)
