"""cache-dit 1.5.3's ``QuantizeConfig.svdq_kwargs``, read for the SVDQuant passes: the smooth strategy, the keys that
change the quantized weights (mapped onto the pass's arguments), the few-shot keys, and the keys that only tune the
reference's own calibration memory and kernels (accepted with a warning: they leave the result unchanged here)."""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

from ..quant.few_shot import DEFAULTS as FEW_SHOT_DEFAULTS, check_options
from ..quant.svdquant import SVD_PRECISIONS

# the reference's SVDQ smooth strategies -> SVDQuantW4A4(smooth=...); "few_shot" -> passes.SVDQuantFewShot
SMOOTH = {"activation": "act", "weight": "weight", "weight_inv": "weight_inv", "identity": "none",
          "few_shot": "few_shot"}
DQ_STRATEGIES = ("identity", "weight", "weight_inv", "few_shot")
PTQ_STRATEGIES = ("activation",)
MAPPED = {"calibrate_precision": "svd_precision", "svd_refine_iters": "refine_iters"}
# svdq_kwargs["few_shot_<name>"] -> SVDQuantFewShot(<name>=...)
FEW_SHOT = {f"few_shot_{k}": k for k in FEW_SHOT_DEFAULTS}
# only place or schedule the reference's own calibration and kernels (its memory, its GEMM variant, where its SVD
# runs, when its helper flows compile): no counterpart here
TUNING_ONLY = ("streaming", "runtime_kernel", "quantize_device", "offload_quantized_layers_to_cpu",
               "layerwise_offload", "async_transfer", "transfer_buckets", "prefetch_limit", "max_copy_streams",
               "max_inflight_prefetch_bytes", "persistent_buckets", "persistent_bins",
               "defer_move_to_execution_device", "activation_buffer_flush_sample_count",
               "activation_buffer_flush_cpu_bytes", "fused_mlp", "few_shot_auto_compile")
KEYS = sorted(["smooth_strategy", *MAPPED, *FEW_SHOT, *TUNING_ONLY])


def smooth_strategy(kwargs: Dict[str, Any], dynamic: bool, quant_type: str) -> str:
    """The smooth strategy (lower-cased): ``kwargs["smooth_strategy"]``, by default "identity" for DQ and
    "activation" for PTQ (the reference's defaults); ValueError naming those the quant type takes."""
    allowed = DQ_STRATEGIES if dynamic else PTQ_STRATEGIES
    value = kwargs.get("smooth_strategy", allowed[0])
    strategy = value.lower() if isinstance(value, str) else value
    if strategy not in allowed:
        extra = "" if dynamic else " (SVDQuant PTQ smooths from its calibration; the others are for the '_dq' types)"
        raise ValueError(f"svdq_kwargs['smooth_strategy']={value!r} is not valid for {quant_type}: use one of "
                         f"{list(allowed)}{extra}")
    return strategy


def svdq_options(kwargs: Dict[str, Any], strategy: Optional[str] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(pass options, few-shot options)`` from ``svdq_kwargs``: SVDQuantW4A4's keyword arguments of the mapped
    keys, and SVDQuantFewShot's ``steps`` / ``relax_*`` (cache-dit's defaults for those not given; validated
    whatever the strategy, as the reference does, and used only with ``strategy="few_shot"``)."""
    if not isinstance(kwargs, dict):
        raise TypeError(f"QuantizeConfig.svdq_kwargs must be a dict, got {type(kwargs).__name__}")
    out: Dict[str, Any] = {}
    few: Dict[str, Any] = dict(FEW_SHOT_DEFAULTS)
    tuning: Dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "smooth_strategy":
            continue
        if key in MAPPED:
            if key == "calibrate_precision":
                value = value.lower() if isinstance(value, str) else value
                if value not in SVD_PRECISIONS:
                    raise ValueError(f"svdq_kwargs['calibrate_precision'] must be one of {SVD_PRECISIONS}, got "
                                     f"{value!r}")
            if key == "svd_refine_iters" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"svdq_kwargs['svd_refine_iters'] must be a non-negative int, got {value!r}")
            out[MAPPED[key]] = value
        elif key in FEW_SHOT:
            few[FEW_SHOT[key]] = value
        elif key in TUNING_ONLY:
            if key == "few_shot_auto_compile" and not isinstance(value, bool):
                raise TypeError(f"svdq_kwargs['few_shot_auto_compile'] must be a bool, got {value!r}")
            tuning[key] = value
        else:
            raise ValueError(f"QuantizeConfig.svdq_kwargs: unknown key {key!r}; cache-dit's keys: {KEYS}")
    if tuning:
        warnings.warn(f"QuantizeConfig.svdq_kwargs {tuning} have no effect here: they place or schedule cache-dit's "
                      "own calibration memory, GEMM kernels and compilation (the quantized weights are the same); "
                      "the passes choose their kernels by device. Drop them", stacklevel=4)
    few = check_options(**few, what="svdq_kwargs['few_shot_{}']", warn=strategy == "few_shot")
    given = sorted(k for k in kwargs if k in FEW_SHOT)
    if given and strategy != "few_shot":
        warnings.warn(f"QuantizeConfig.svdq_kwargs {given} have no effect with smooth_strategy={strategy!r} (as in "
                      "cache-dit, they are read only with smooth_strategy='few_shot')", stacklevel=4)
    return out, few


__all__ = ["SMOOTH", "DQ_STRATEGIES", "KEYS", "smooth_strategy", "svdq_options"]
