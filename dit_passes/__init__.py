"""dit_passes: graph passes that make diffusers Diffusion Transformers fast.

    from dit_passes import compile_dit, passes
    compiled = compile_dit(pipe.transformer, passes=[passes.DBCache()])
    pipe.transformer = compiled
"""
from __future__ import annotations

import importlib.util as _importlib_util
import os as _os

# The one check of the package layout, before anything else is imported: kernels/ and patterns/ are top-level
# folders of the repository that only an install (regular or editable) maps to dit_passes.kernels /
# dit_passes.patterns.
if _importlib_util.find_spec("dit_passes.kernels") is None or _importlib_util.find_spec("dit_passes.patterns") is None:
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    raise ImportError(f"dit_passes was imported from {_root} without dit_passes.kernels / dit_passes.patterns: "
                      f"this source checkout is not installed. Run `pip install -e .` in {_root} (with the "
                      "dependencies already present: `pip install --no-deps --no-build-isolation -e .`). With a "
                      "regular install, do not put the repository root on sys.path (use `python -P`).")

from typing import Any, Dict, List, Optional, Sequence

import torch

from .backend import InductorPostGradPass, backend
from .capture import CaptureError, capture
from .compiled import DEFAULT_MAX_GRAPHS, CompiledDiT, Runtime
from .infra.pass_base import Pass, PassContext, PassError, PassResult
from .infra.pass_manager import PassManager
from .infra.weight_source import SafetensorsWeights
from .analysis.blocks import NoRepeatedBlocksError, get_structure
from . import passes  # noqa: F401  (dit_passes.passes.<PassName>)
from .passes.vae_parallel import parallel_vae  # noqa: F401  (VAE-P: dit_passes.parallel_vae(pipe.vae, size=2))

__version__ = "0.1.0"


def compile_dit(model: torch.nn.Module, passes: Sequence[Pass] = (), *, example_inputs: Optional[Dict[str, Any]] = None,
                dump_dir: Optional[str] = None, block_lists: Optional[List[str]] = None,
                cleanup: bool = True, torch_compile: Optional[Dict[str, Any]] = None,
                keep_original: bool = False, weights: Any = None, device: Any = None,
                max_graphs: Optional[int] = DEFAULT_MAX_GRAPHS) -> CompiledDiT:
    """Wrap ``model`` in a :class:`CompiledDiT` that runs ``passes`` on its captured graph.

    With ``example_inputs`` (the keyword arguments of one call) capture happens now; otherwise at the first
    call. ``dump_dir`` writes the graph after every pass; ``block_lists`` overrides block discovery's
    choice of the main stack (names of ModuleLists, e.g. ``["layers"]``). ``torch_compile``: keyword
    arguments of ``torch.compile`` applied to each lowered graph (``{}`` for the defaults: Inductor,
    ``fullgraph=True``); the graph, cache branch included, then compiles as one. With ``"regional": True``
    in it, the other keys go to :class:`~dit_passes.passes.RegionalCompile` instead, which compiles each
    distinct block program once and leaves the rest eager (a much shorter first generation). ``{"regional": True,
    "mode": "reduce-overhead"}`` also replays each call as one CUDA graph, the cache decision a conditional node
    read by the GPU (no host sync per step; CUDA >= 12.4, see :mod:`dit_passes.infra.cuda_graph_step`).

    Weights a pass replaces (shards, quantized tables) leave ``model``: its parameters become meta tensors (or
    the replacement itself, when shape and dtype match), so each weight is held once (``compiled.released``,
    ``compiled.memory_report()``). ``keep_original=True`` keeps ``model`` whole instead, at the cost of a full
    copy of every replaced weight besides what the passes made (then it can still run, be restored, reloaded).

    ``weights``: the checkpoint of a model built on the meta device (``with torch.device("meta"): model = ...``):
    a safetensors file, a list of them, a directory, or a :class:`~dit_passes.infra.weight_source.SafetensorsWeights`
    (whose ``bytes_read`` counts what was read). Each weight still on the meta device is read while lowering onto
    ``device`` (default: the inputs' device), once: tensor parallelism reads only its rank's slice, the rest is read
    whole and shared by the graph and ``model``. Without ``weights``, meta weights and real inputs are refused.

    ``max_graphs``: the most lowered graphs (one per input signature: resolution, batch, text length, constant
    arguments) the module keeps, the least recently called evicted beyond it (``compiled.graph_stats``; a
    RuntimeWarning when new signatures keep evicting); default :data:`~dit_passes.compiled.DEFAULT_MAX_GRAPHS`
    (8), None for no limit. Settable later as ``compiled.max_graphs``.
    """
    compiled = CompiledDiT(model, passes, cleanup=cleanup, dump_dir=dump_dir, block_lists=block_lists,
                           torch_compile=torch_compile, keep_original=keep_original, weights=weights, device=device,
                           max_graphs=max_graphs)
    if example_inputs is not None:
        compiled.lower(**example_inputs)
    return compiled


# cache-dit-compatible front end: `import dit_passes as cache_dit`
from .frontend import (CacheStats, DBCacheConfig, DBPruneConfig, DMDCalibratorConfig, FoCaCalibratorConfig,  # noqa: E402
                       ParallelismConfig, QuantizeConfig,
                       TaylorSeerCalibratorConfig, FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig,
                       SeaCacheConfig, TeaCacheConfig, PyramidAttentionBroadcastConfig, FasterCacheConfig,
                       TextKVCacheConfig, disable_cache, enable_cache, layerwise_offload, load, quantize,
                       refresh_context, steps_mask,
                       strify, summary, load_configs, load_cache_config, load_parallelism_config,
                       load_quantize_config, load_attn_backend_config, load_options, layerwise_cpu_offload,
                       BasicCacheConfig, CacheType, CalibratorConfig, DBCache, DBPrune, NONE, block_range, cache_type,
                       disable_print, init_logger, maybe_empty_cache, set_attn_backend, ParallelismBackend,
                       QuantizeBackend, ProfilerContext, create_profiler_context, get_profiler_output_dir,
                       profile_function, set_profiler_output_dir, set_compile_configs, supported_matrix,
                       supported_pipelines, parse_extra_modules, LayerwiseOffloadHandle,
                       LayerwiseOffloadHandleGroup, get_layerwise_offload_handles, remove_layerwise_offload)
from .frontend import version_tuple as _version_tuple  # noqa: E402
from .frontend import NOT_OFFERED as _NOT_OFFERED  # noqa: E402

version_tuple = _version_tuple(__version__)  # cache-dit's: this package's version as numbers
# cache-dit's names dit_passes does not offer: each raises at its first use, with the reason and what to use
globals().update(_NOT_OFFERED)

__all__ = ["compile_dit", "CompiledDiT", "Runtime", "backend", "InductorPostGradPass", "capture", "Pass",
           "PassContext", "PassResult", "PassManager", "PassError", "CaptureError", "NoRepeatedBlocksError",
           "get_structure", "passes", "SafetensorsWeights",
           "enable_cache", "disable_cache", "layerwise_offload", "refresh_context", "summary", "strify", "steps_mask",
           "quantize", "load", "CacheStats", "DBCacheConfig", "DBPruneConfig", "TaylorSeerCalibratorConfig",
           "FoCaCalibratorConfig", "DMDCalibratorConfig", "FirstBlockCacheConfig",
           "MagCacheConfig", "TaylorSeerCacheConfig", "SeaCacheConfig", "TeaCacheConfig",
           "PyramidAttentionBroadcastConfig", "FasterCacheConfig", "TextKVCacheConfig",
           "ParallelismConfig", "QuantizeConfig", "load_configs", "load_cache_config", "load_parallelism_config",
           "load_quantize_config", "load_attn_backend_config", "load_options", "layerwise_cpu_offload",
           "BasicCacheConfig", "CacheType", "CalibratorConfig", "DBCache", "DBPrune", "NONE", "block_range",
           "cache_type", "disable_print", "init_logger", "maybe_empty_cache", "version_tuple", "set_attn_backend",
           "ParallelismBackend", "QuantizeBackend", "ProfilerContext", "create_profiler_context",
           "get_profiler_output_dir", "profile_function", "set_profiler_output_dir", "set_compile_configs",
           "supported_matrix", "supported_pipelines", "parse_extra_modules", "LayerwiseOffloadHandle",
           "LayerwiseOffloadHandleGroup", "get_layerwise_offload_handles", "remove_layerwise_offload"]
