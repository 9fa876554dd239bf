"""cache-dit's ``set_compile_configs``: its process-wide ``torch._dynamo`` / ``torch._inductor`` settings for
``torch.compile`` on DiTs, the same knobs to the same values.

Each knob is set where this torch has it; a knob this torch lacks is named in a warning (cache-dit passes over it
without a word). Three differences, each because settings are arguments here:

- cache-dit reads three environment variables; here they are arguments: ``CACHE_DIT_EPILOGUE_PROLOGUE_FUSION`` is
  the ``epilogue_prologue_fusion`` keyword (cache-dit also takes it as a keyword), ``CACHE_DIT_FORCE_DISABLE_CUSTOM_
  COMPILE_CONFIG`` is ``descent_tuning=False``, ``CACHE_DIT_ENABLE_COMPILE_COMPUTE_COMM_OVERLAP`` (on by default
  there) is ``compute_comm_overlap``.
- cache-dit accepts any other keyword and drops it; here an unknown keyword is a ``TypeError`` naming it.
- cache-dit swallows any error of its own; here one propagates.

Ascend NPUs (cache-dit's second branch) are not supported by dit_passes: the CUDA / CPU branch is the one taken.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)

_KWARGS = ("epilogue_prologue_fusion",)


def _set(config: Any, knobs: Dict[str, Any], skipped: List[str], prefix: str) -> None:
    for name, value in knobs.items():
        if hasattr(config, name):
            setattr(config, name, value)
        else:
            skipped.append(f"{prefix}.{name}")


def set_compile_configs(descent_tuning: bool = True, cuda_graphs: bool = False,
                        force_disable_compile_caches: bool = False, fx_graph_cache: bool = True,
                        fx_graph_remote_cache: bool = False, autotune_local_cache: bool = False,
                        use_fast_math: bool = False, compute_comm_overlap: bool = True, ulysses_anything: bool = False,
                        capture_scalar_outputs: Optional[bool] = None,
                        capture_dynamic_output_shape_ops: Optional[bool] = None,
                        cutedsl_enable_autotuning: Optional[bool] = None, **kwargs: Any) -> List[str]:
    """Set cache-dit's ``torch.compile`` configuration (see the module docstring); returns the knobs this torch
    lacks (also warned), empty when every one was set."""
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise TypeError(f"set_compile_configs: unknown keyword(s) {unknown}; cache-dit's extra keyword is "
                        f"{list(_KWARGS)}")
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    skipped: List[str] = []
    dynamo: Dict[str, Any] = {"recompile_limit": 1024, "accumulated_recompile_limit": 8192}
    if capture_scalar_outputs is None and ulysses_anything:
        # Ulysses with uneven splits reads sizes with Tensor.item(): capture it instead of breaking the graph
        capture_scalar_outputs = True
    if capture_scalar_outputs is not None:
        dynamo["capture_scalar_outputs"] = capture_scalar_outputs
    if capture_dynamic_output_shape_ops is not None:
        dynamo["capture_dynamic_output_shape_ops"] = capture_dynamic_output_shape_ops
    _set(dynamo_config, dynamo, skipped, "torch._dynamo.config")

    inductor: Dict[str, Any] = {"fx_graph_cache": fx_graph_cache, "fx_graph_remote_cache": fx_graph_remote_cache,
                                "autotune_local_cache": autotune_local_cache}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        inductor["reorder_for_compute_comm_overlap"] = compute_comm_overlap
        if compute_comm_overlap:  # cache-dit's bandwidths (GB/s): L20 over PCIe, else NVLink
            name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            inductor["intra_node_bw"] = 64 if "L20" in name else 300
    if cutedsl_enable_autotuning is not None:
        inductor["cutedsl_enable_autotuning"] = cutedsl_enable_autotuning
    if descent_tuning:
        inductor.update({"max_fusion_size": 64, "max_pointwise_cat_inputs": 8, "triton.cudagraphs": cuda_graphs,
                         "triton.use_block_ptr": False, "triton.codegen_upcast_to_fp32": True,
                         "conv_1x1_as_mm": True, "coordinate_descent_tuning": True,
                         "coordinate_descent_check_all_directions": True, "epilogue_fusion": False})
        if kwargs.get("epilogue_prologue_fusion", False):
            inductor.update({"epilogue_fusion": True, "prologue_fusion": True, "epilogue_fusion_first": True})
        inductor["dce"] = True
        if force_disable_compile_caches:
            inductor.update({"force_disable_caches": True, "fx_graph_cache": False, "fx_graph_remote_cache": False,
                             "autotune_local_cache": False})
        inductor["use_fast_math"] = use_fast_math
        inductor["cuda.use_fast_math"] = use_fast_math
    _set(inductor_config, inductor, skipped, "torch._inductor.config")
    if skipped:
        logger.warning("set_compile_configs: this torch (%s) has no %s; left unset", torch.__version__, skipped)
    return skipped
