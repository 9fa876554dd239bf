"""The front end's code that runs on Ray workers (``use_ray=True``): an extra module's parallel version
(:func:`worker_extra`, a text encoder's quantization after its TE-P), SVDQuant PTQ calibrated where the transformer
runs (:func:`calibrate_on_workers`: the driver's ``calibrate_fn`` runs the pipeline, whose transformer calls reach the
workers' ``forward_hook``), and what ``ray_transfer_fn`` needs once each worker has built its own pipeline
(:func:`setup_factory_workers`: the named ``extra_parallel_modules`` parallelised, ``components_to_quantize``
quantized and SVDQuant PTQ calibrated there, ``calibrate_fn`` running in each worker as cache-dit's does)."""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import components
from .calibration import calibrate, call_calibrate_fn, reduce_max
from .configs import ParallelismConfig, QuantizeConfig

Configs = Tuple[Optional[QuantizeConfig], ...]  # one per components.TRANSFORMER_NAMES entry


def worker_extra(pc: ParallelismConfig, quant: Dict[int, QuantizeConfig], module: torch.nn.Module, rank: int,
                 world_size: int, index: int = 0) -> torch.nn.Module:
    """An extra module's parallel version, in a Ray worker (the single process's rule: a VAE split by rows, a
    ControlNet with the transformer's passes, a text encoder with tensor parallelism over all ranks), then the
    quantization ``quant[index]`` asks for (a text encoder also in ``components_to_quantize``)."""
    from ..passes.parallel_plan import parallelize_module
    # a callable: a VAE builds its quantization for each graph it captures
    then = functools.partial(_one_writer(quant[index], rank).to_passes, module) if index in quant else ()
    return parallelize_module(module, world_size, pc.to_passes, then=then)


def _one_writer(q: QuantizeConfig, rank: int) -> QuantizeConfig:
    """``q`` as rank ``rank`` applies it: only rank 0 writes ``serialize_to`` (the ranks share the directory)."""
    return q if rank == 0 or q.serialize_to is None else dataclasses.replace(q, serialize_to=None)


class _CalibrationHook:
    """A Ray worker's ``forward_hook`` during SVDQuant PTQ calibration: each step runs the transformer's original
    module (no passes: every rank sees the whole model and the same inputs) and records each linear's input
    abs-max, the max over steps as one observer would; the first step's inputs are kept to lower with."""

    def __init__(self) -> None:
        self.stats: Dict[int, Dict[str, torch.Tensor]] = {}
        self.first: Dict[int, Dict[str, Any]] = {}

    def __call__(self, worker: Any, index: int, kwargs: Dict[str, Any]) -> Any:
        from ..passes.quantize import calibrate_linears
        module = worker.compiled[index].original
        weights = {p: m.weight for p, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        out: list = []
        seen = calibrate_linears(weights, lambda: out.append(module(**kwargs)))
        mine = self.stats.setdefault(index, {})
        for path, absmax in seen.items():
            mine[path] = absmax if path not in mine else torch.maximum(mine[path], absmax)
        if index not in self.first:
            with torch.inference_mode(False):
                self.first[index] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return out[0]


def _worker_begin_calibration(worker: Any) -> None:  # runs on a Ray worker
    worker.forward_hook = _CalibrationHook()


def _quantize_one(worker: Any, index: int, q: QuantizeConfig, stats: Dict[str, Any], example: Dict[str, Any]) -> None:
    """The ``index``-th transformer gets the PTQ pass(es) for ``stats`` and is lowered now with ``example`` (rank 0
    writes ``serialize_to``, as the single process does before enable_cache returns)."""
    compiled = worker.compiled[index]
    quant = q.to_passes(compiled.original, stats)
    if worker.rank != 0:
        for p in quant:
            p.serialize_to = None  # one writer
    worker.set_passes(index, lambda passes, quant=quant: list(passes) + quant)
    with torch.inference_mode():
        compiled.lower(**worker._to_device(example))


def _is_ptq(qs: Configs, index: int) -> bool:
    return index < len(qs) and qs[index] is not None and qs[index].is_ptq()


def _worker_quantize(worker: Any, qs: Configs) -> List[List[str]]:  # runs on a Ray worker
    """After calibration: each PTQ transformer gets its pass(es) for its statistics and is lowered now."""
    hook, worker.forward_hook = worker.forward_hook, None
    for index in range(len(worker.compiled)):
        if not _is_ptq(qs, index):
            continue
        if not hook.stats.get(index):
            raise ValueError(f"QuantizeConfig.calibrate_fn never called transformer {index} (it must run the "
                             "pipeline enable_cache was given)")
        _quantize_one(worker, index, qs[index], hook.stats[index], hook.first[index])
    return [[p.name for p in c.passes] for c in worker.compiled]


def calibrate_on_workers(engine: Any, qs: Configs) -> None:
    """SVDQuant PTQ with the pipeline here: ``calibrate_fn`` runs once in this process (``model=``: the first PTQ
    transformer's proxy) while the workers observe the transformer(s) they run; then they quantize."""
    index = next(i for i in range(len(qs)) if _is_ptq(qs, i))
    engine.run_on_workers(_worker_begin_calibration)
    try:
        call_calibrate_fn(qs[index], engine.as_transformer(index))
    except BaseException:
        engine.run_on_workers(_worker_end_calibration)
        raise
    engine.run_on_workers(_worker_quantize, tuple(_without_calibrate_fn(q) for q in qs))


def _without_calibrate_fn(q: Optional[QuantizeConfig]) -> Optional[QuantizeConfig]:
    """``q`` without its ``calibrate_fn`` (it holds this process's pipeline: it stays here); a PTQ config gets a
    stand-in that refuses to run (the config stays valid: the workers rebuild per-component configs from it)."""
    if q is None or q.calibrate_fn is None:
        return q
    out = copy.copy(q)
    out.calibrate_fn = _calibrated_elsewhere if q.is_ptq() else None
    return out


def _calibrated_elsewhere() -> None:
    raise RuntimeError("SVDQuant PTQ on Ray workers: calibrate_fn ran where the pipeline is (the statistics were "
                       "recorded then); nothing is calibrated again from this copy of the config")


def _worker_end_calibration(worker: Any) -> None:  # runs on a Ray worker
    worker.forward_hook = None


# ------------------------------------------------------------------------------------------ ray_transfer_fn
@dataclasses.dataclass
class FactoryPlan:
    """What ``enable_cache(None, parallelism_config=ParallelismConfig(use_ray=True, ray_transfer_fn=...), ...)``
    asks of the pipelines the workers build, by name (checked here, resolved there)."""

    extra_names: List[str]  # extra_parallel_modules
    transformers: Configs  # the transformers' quantize configs
    others: List[Tuple[str, QuantizeConfig]]  # (component name, config): components_to_quantize beyond them

    @classmethod
    def of(cls, pc: ParallelismConfig, q: Optional[QuantizeConfig]) -> "FactoryPlan":
        names = list(pc.extra_parallel_modules or [])
        given = [type(m).__name__ for m in names if not isinstance(m, str)]
        if given:
            raise ValueError(f"ParallelismConfig.extra_parallel_modules={given} with ray_transfer_fn: each worker "
                             "builds its own pipeline, so modules of this process name nothing there; name them "
                             "(e.g. ['text_encoder', 'vae']), as resolved in each worker's pipeline")
        by_name: Dict[str, Optional[QuantizeConfig]] = {}
        others: List[Tuple[str, QuantizeConfig]] = []
        if q is not None:
            for component, cfg in q.component_configs():
                if not isinstance(component, str):
                    raise ValueError(f"QuantizeConfig.components_to_quantize: a {type(component).__name__} of this "
                                     "process with ray_transfer_fn: each worker builds its own pipeline; name the "
                                     "component (e.g. 'text_encoder')")
                if component in components.TRANSFORMER_NAMES:
                    by_name[component] = cfg
                else:  # float8 / int8: its calibrate_fn, inherited, is SVDQuant's (it stays here)
                    others.append((component, _without_calibrate_fn(cfg)))
            if q.components_to_quantize is None:
                by_name = {n: q for n in components.TRANSFORMER_NAMES}
        if len({n for n, _ in others}) != len(others):
            raise ValueError(f"QuantizeConfig.components_to_quantize names one component twice: {others}")
        for _, cfg in others:  # validated here (a filter_fn needs the module: there)
            (cfg if cfg.filter_fn is None else dataclasses.replace(cfg, filter_fn=None)).to_passes()
        return cls(names, tuple(by_name.get(n) for n in components.TRANSFORMER_NAMES), others)

    def needs_setup(self) -> bool:
        return bool(self.extra_names or self.others or any(_is_ptq(self.transformers, i)
                                                          for i in range(len(self.transformers))))


def _worker_setup(worker: Any, pc: ParallelismConfig, plan: FactoryPlan) -> Dict[str, Any]:  # runs on a Ray worker
    """In the pipeline this worker built: the named extra modules parallelised (a text encoder also to quantize:
    its TP passes, then its quantization), the other components quantized, then each PTQ transformer calibrated by
    ``calibrate_fn`` (``model=`` this worker's transformer, every rank the same calls; their statistics merged by
    max so the shards agree) and quantized. Returns what it did, for the driver's log and tests."""
    from ..passes.parallel_plan import parallelize_extra_modules
    pipe = worker.obj
    extras = components.extra_modules(pipe, plan.extra_names)
    others = [(components.resolve(pipe, name), _one_writer(cfg, worker.rank)) for name, cfg in plan.others]
    quantized, deferred = components.quantize_components(pipe, others, keep_original=False, skip=extras)
    parallel = parallelize_extra_modules(pipe, extras, worker.world_size, pc.to_passes, then=deferred) \
        if extras else []
    names = [n for n in components.TRANSFORMER_NAMES if isinstance(getattr(pipe, n, None), torch.nn.Module)]
    calibrated = []
    for index, compiled in enumerate(worker.compiled):
        q = plan.transformers[components.TRANSFORMER_NAMES.index(names[index])]
        if q is None or not q.is_ptq():
            continue
        stats, example = calibrate(q, compiled.original)
        _quantize_one(worker, index, q, reduce_max(stats), example)
        calibrated.append(names[index])
    return {"parallel": [a for a, _ in parallel], "quantized": [a for a, _ in quantized] + [
        a for a, m in parallel if id(m) in deferred], "calibrated": calibrated}


def setup_factory_workers(engine: Any, pc: ParallelismConfig, plan: FactoryPlan) -> List[Dict[str, Any]]:
    """Run :func:`_worker_setup` on every worker (``pc`` without its extra modules, which are names here)."""
    return engine.run_on_workers(_worker_setup, pc, plan)


def without_calibrate_fns(qs: Sequence[Optional[QuantizeConfig]]) -> Configs:
    return tuple(_without_calibrate_fn(q) for q in qs)


__all__ = ["calibrate_on_workers", "worker_extra", "FactoryPlan", "setup_factory_workers", "without_calibrate_fns"]
