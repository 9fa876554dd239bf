"""The front end's reports: :class:`CacheStats` (cache-dit's fields for the last generation) built from the
compiled transformers' cache records, ``summary`` and the reference's ``strify`` tag. A Ray-run transformer's
records are read on its workers (``_worker_cache_summary``)."""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional

from ..cache.prune import PRUNE_FIELDS
from ..cache.stats import CFG_CONTEXTS
from ..compiled import CompiledDiT
from .api import FrontendState, _name, _state_of, _targets
from .cache_configs import cache_tag
from .configs import ParallelismConfig, QuantizeConfig

logger = logging.getLogger("dit_passes")


@dataclasses.dataclass
class CacheStats:
    """cache-dit's ``CacheStats`` fields for the last generation, plus ``residual_diff_stats`` (percentiles) and
    ``generations`` (every generation's record, ``CompiledDiT.cache_summary(as_dict=True)``). ``stats[key]`` works."""

    cache_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    cached_steps: List[int] = dataclasses.field(default_factory=list)
    residual_diffs: Dict[str, float] = dataclasses.field(default_factory=dict)
    cfg_cached_steps: List[int] = dataclasses.field(default_factory=list)
    cfg_residual_diffs: Dict[str, float] = dataclasses.field(default_factory=dict)
    accumulated_cached_steps: int = 0
    cfg_accumulated_cached_steps: int = 0
    accumulated_executed_steps: int = 0
    accumulated_transformer_executed_steps: int = 0
    residual_diff_stats: Dict[str, float] = dataclasses.field(default_factory=dict)
    cfg_residual_diff_stats: Dict[str, float] = dataclasses.field(default_factory=dict)
    # Dynamic Block Prune (DBPruneConfig): per call, the pruned and the existing blocks
    pruned_steps: List[int] = dataclasses.field(default_factory=list)
    pruned_blocks: List[int] = dataclasses.field(default_factory=list)
    actual_blocks: List[int] = dataclasses.field(default_factory=list)
    pruned_ratio: Optional[float] = None
    cfg_pruned_steps: List[int] = dataclasses.field(default_factory=list)
    cfg_pruned_blocks: List[int] = dataclasses.field(default_factory=list)
    cfg_actual_blocks: List[int] = dataclasses.field(default_factory=list)
    cfg_pruned_ratio: Optional[float] = None
    parallelism_config: Optional[ParallelismConfig] = None
    quantize_config: Optional[QuantizeConfig] = None
    generations: List[Dict[str, Any]] = dataclasses.field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def as_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _worker_cache_summary(worker: Any, index: int = 0) -> List[Dict[str, Any]]:  # runs on a Ray worker
    compiled = worker.compiled[index]
    return compiled.cache_summary(as_dict=True) if compiled.cache_report() is not None else []



def stats_from_summary(gens: List[Dict[str, Any]], state: Optional[FrontendState] = None) -> CacheStats:
    """A :class:`CacheStats` from ``CompiledDiT.cache_summary(as_dict=True)`` (its last generation)."""
    st = CacheStats(generations=list(gens))
    if state is not None:
        st.cache_options = state.cache_options()
        cfg = st.cache_options.get("cache_config")
        if gens and getattr(cfg, "enable_separate_cfg", False) is None:
            # as the reference's tag, which shows what its pipeline table resolved None to: what the calls showed
            seen = any(n in CFG_CONTEXTS or n.endswith("/cfg") for g in gens for n in g.get("contexts", {}))
            st.cache_options = dict(st.cache_options, cache_config=dataclasses.replace(cfg, enable_separate_cfg=seen))
        st.parallelism_config, st.quantize_config = state.parallelism_config, state.quantize_config
    if gens:
        g = gens[-1]
        for k in ("cached_steps", "residual_diffs", "residual_diff_stats", "cfg_cached_steps", "cfg_residual_diffs",
                  "cfg_residual_diff_stats") + PRUNE_FIELDS + tuple("cfg_" + f for f in PRUNE_FIELDS):
            if g.get(k) is not None:
                setattr(st, k, copy.deepcopy(g[k]))
        st.accumulated_cached_steps = len(st.cached_steps)
        st.cfg_accumulated_cached_steps = len(st.cfg_cached_steps)
        ctxs = g.get("contexts", {})
        st.accumulated_executed_steps = max((c["executed_steps"] for n, c in ctxs.items()
                                             if n not in ("cfg", "uncond")), default=0)
        st.accumulated_transformer_executed_steps = sum(c["executed_steps"] for c in ctxs.values())
    return st


def summary(pipe_or_module: Any, details: bool = False, logging: bool = True, **kwargs: Any) -> List[CacheStats]:
    """One :class:`CacheStats` per accelerated transformer, ``[CacheStats()]`` when none is (as the reference).
    Reads the device once (the cache records); ``logging`` logs the per-generation table, and with ``details`` the
    reference's detail lines too (:func:`details_text`: every cached step and residual diff)."""
    if pipe_or_module is None:
        return [CacheStats()]
    out = []
    for _, attr, module in _targets(pipe_or_module):
        state = _state_of(module)
        if state is None:
            continue
        if state.engine is not None:
            gens = state.engine.run_on_workers(_worker_cache_summary, state.engine_index)[0] \
                if state.cache_config is not None else []
        else:
            gens = module.cache_summary(as_dict=True) if module.cache_report() is not None else []
        st = stats_from_summary(gens, state)
        out.append(st)
        if logging:
            table = module.cache_summary() if isinstance(module, CompiledDiT) and gens else ""
            logger.info("summary(%s): %s\n%s", _name(attr, module), strify(st) or "(no acceleration)", table)
            if details and gens:
                logger.info("%s", details_text(st, _name(attr, module)))
    return out or [CacheStats()]


def details_text(st: CacheStats, name: str) -> str:
    """``summary(details=True)``: the reference's detail lines, the cached (or pruned) steps and every residual
    diff of the last generation, per branch (CFG: the ``cfg_`` fields)."""
    lines = []
    for prefix, label in (("", ""), ("cfg_", "CFG ")):
        diffs = getattr(st, prefix + "residual_diffs")
        if prefix and not diffs:
            continue
        if getattr(st, prefix + "pruned_ratio") is not None:
            pruned, actual = getattr(st, prefix + "pruned_blocks"), getattr(st, prefix + "actual_blocks")
            lines += [f"{label}Pruned Blocks and Residual Diffs Details: {name}",
                      f"{label}Pruned Blocks: {len(pruned)}, {pruned}",
                      f"{label}Actual Blocks: {len(actual)}, {actual}"]
        else:
            steps = getattr(st, prefix + "cached_steps")
            lines += [f"{label}Cache Steps and Residual Diffs Details: {name}",
                      f"{label}Cache Steps: {getattr(st, prefix + 'accumulated_cached_steps')}, {steps}"]
        lines.append(f"{label}Residual Diffs: {len(diffs)}, {diffs}")
    return "\n".join(lines)


def strify(pipe_or_stats: Any) -> str:
    """The reference's tag, e.g. ``DBCache_F8B0_W8I1M0MC0_R0.08_T0O0_S12`` (+ ``_Ulysses2``, ``_float8_per_row``)."""
    if isinstance(pipe_or_stats, list):
        pipe_or_stats = pipe_or_stats[0] if pipe_or_stats else CacheStats()
    if isinstance(pipe_or_stats, dict):  # the reference's context kwargs: {"cache_config": ..., ...}
        options, acc = pipe_or_stats, None
        par, quant = pipe_or_stats.get("parallelism_config"), pipe_or_stats.get("quantize_config")
    else:
        st = pipe_or_stats if isinstance(pipe_or_stats, CacheStats) else summary(pipe_or_stats, logging=False)[0]
        options, acc, par, quant = st.cache_options, st.accumulated_cached_steps, st.parallelism_config, st.quantize_config
    ratio = None if isinstance(pipe_or_stats, dict) else st.pruned_ratio
    cfg, parts = options.get("cache_config"), []
    if cfg is not None:
        cal = options.get("calibrator_config")
        parts.append(cache_tag(cfg, cal, ratio))
    parts += [extra.strify() for extra in (par, quant) if extra is not None and extra.strify()]
    return "_".join(parts) + (f"_S{acc}" if acc and cfg is not None else "")
