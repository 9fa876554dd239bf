"""The front end's code that runs on Ray workers (``use_ray=True``): an extra module's parallel version
(:func:`worker_extra`) and SVDQuant PTQ calibrated where the transformer runs (:func:`calibrate_on_workers`: the
driver's ``calibrate_fn`` runs the pipeline, whose transformer calls reach the workers' ``forward_hook``)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch

from .configs import ParallelismConfig, QuantizeConfig


def worker_extra(pc: ParallelismConfig, module: torch.nn.Module, rank: int, world_size: int) -> torch.nn.Module:
    """An extra module's parallel version, in a Ray worker (the single process's rule: a VAE split by rows, a
    ControlNet with the transformer's passes, a text encoder with tensor parallelism over all ranks)."""
    from ..passes.parallel_plan import parallelize_module
    return parallelize_module(module, world_size, pc.to_passes)


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


def _worker_quantize(worker: Any, q: QuantizeConfig) -> List[List[str]]:  # runs on a Ray worker
    """After calibration: each transformer gets the PTQ pass(es) for its statistics and is lowered now (rank 0
    writes ``serialize_to``, as the single process does before enable_cache returns)."""
    hook, worker.forward_hook = worker.forward_hook, None
    names = []
    for index, compiled in enumerate(worker.compiled):
        if not hook.stats.get(index):
            raise ValueError(f"QuantizeConfig.calibrate_fn never called transformer {index} (it must run the "
                             "pipeline enable_cache was given)")
        quant = q.to_passes(compiled.original, hook.stats[index])
        if worker.rank != 0:
            for p in quant:
                p.serialize_to = None  # one writer
        worker.set_passes(index, lambda passes, quant=quant: list(passes) + quant)
        with torch.inference_mode():
            compiled.lower(**worker._to_device(hook.first[index]))
        names.append([p.name for p in compiled.passes])
    return names


def calibrate_on_workers(engine: Any, q: QuantizeConfig) -> None:
    engine.run_on_workers(_worker_begin_calibration)
    try:
        q.calibrate_fn()
    except BaseException:
        engine.run_on_workers(_worker_end_calibration)
        raise
    stripped = copy.copy(q)
    stripped.calibrate_fn = _calibrated_on_workers  # the statistics are the workers'; the pipeline stays here
    engine.run_on_workers(_worker_quantize, stripped)


def _calibrated_on_workers() -> None:
    raise RuntimeError("SVDQuant PTQ on Ray workers: the statistics were recorded while calibrate_fn ran the "
                       "pipeline in the driver; nothing is calibrated again in a worker")


def _worker_end_calibration(worker: Any) -> None:  # runs on a Ray worker
    worker.forward_hook = None


__all__ = ["calibrate_on_workers", "worker_extra"]
