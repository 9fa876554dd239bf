"""SVDQuant PTQ calibration for the front end: ``calibrate_fn`` run once while the linears' input abs-max is
observed (:func:`calibrate`), called as cache-dit 1.5.3 calls it (:func:`call_calibrate_fn`: the keyword arguments it
names among ``model``, ``quantize_config``, ``component_name``, ``svdq_kwargs``), and the statistics of several
ranks merged (:func:`reduce_max`) so that every rank quantizes from the same numbers."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Tuple

import torch

from ..passes.quantize import calibrate_linears

# what cache-dit offers calibrate_fn besides these: its own observer object ("calibrator"), which has no counterpart
# here (the linears are observed around the call)
_NOT_OFFERED = ("calibrator",)


def call_calibrate_fn(config: Any, model: Any, component_name: str = "") -> Any:
    """``config.calibrate_fn(...)`` with those of ``model=`` (the transformer being calibrated: with ``use_ray``
    the proxy that runs it on the workers, or the workers' own copy when ``ray_transfer_fn`` built it there),
    ``quantize_config=``, ``component_name=`` and ``svdq_kwargs=`` it names (all of them for ``**kwargs``); a
    function naming none is called with no argument."""
    fn = config.calibrate_fn
    offered = dict(model=model, quantize_config=config, component_name=component_name or type(model).__name__,
                   svdq_kwargs=dict(config.svdq_kwargs or {}))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the reference passes everything
        return fn(**offered)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**offered)
    missing = [n for n, p in params.items() if n in _NOT_OFFERED and p.default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"QuantizeConfig.calibrate_fn requires {missing}: cache-dit's own observer object, which "
                        "dit_passes does not have (it observes the linears around the call); give it a default or "
                        "drop it (offered: model, quantize_config, component_name, svdq_kwargs)")
    return fn(**{k: v for k, v in offered.items() if k in params})


def calibrate(config: Any, model: Any, driven: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Run ``config.calibrate_fn`` once: the activation abs-max of every ``nn.Linear`` of ``model`` it calls,
    and the keyword arguments of ``model``'s first call (to lower the graph now). ``model`` must be the
    module the pipeline calls, not yet wrapped; ``driven``: what calibrate_fn gets as ``model=`` (``model``
    itself unless given)."""
    import torch.utils._pytree as pytree
    weights = {p: m.weight for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    first: List[Dict[str, Any]] = []

    def record(_mod, args, kwargs):
        if not first:
            if args:
                raise TypeError("calibrate_fn called the transformer with positional arguments; call it with "
                                "keywords, as diffusers pipelines do")
            first.append(pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, kwargs))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)  # public hook, removed below
    try:
        stats = calibrate_linears(weights, lambda: call_calibrate_fn(config, model if driven is None else driven))
    finally:
        handle.remove()
    if not first or not stats:
        raise ValueError("QuantizeConfig.calibrate_fn never called the transformer being quantized: it must run "
                         "the pipeline that holds this transformer (before enable_cache / quantize wraps it), or "
                         "call the model= it is given")
    with torch.inference_mode(False):
        example = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, first[0])
    return stats, example


def reduce_max(stats: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The element-wise max of each rank's ``stats`` over the default process group (every rank must call it,
    with the same linears: the same model). Ranks that each ran ``calibrate_fn`` themselves agree only if it is
    deterministic; the tensor-parallel shards of one linear must come from one set of numbers."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    keys = sorted(stats)
    names: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, keys)
    if any(n != keys for n in names):
        raise RuntimeError("SVDQuant PTQ on Ray workers: calibrate_fn called different linears on different ranks "
                           "(it must run the same calls on every rank)")
    flat = torch.cat([stats[k].detach().float().reshape(-1) for k in keys])  # one all-reduce for every linear
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    out, at = {}, 0
    for k in keys:
        n = stats[k].numel()
        out[k] = flat[at:at + n].reshape(stats[k].shape).to(stats[k].dtype)
        at += n
    return out


__all__ = ["calibrate", "call_calibrate_fn", "reduce_max"]
