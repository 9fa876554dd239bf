"""Dynamic block pruning (cache-dit 1.5.3's DBPrune) as pure tensor code: one decision per prunable block.

Reference: ``PrunedBlocks_Pattern_Base.compute_or_prune`` (cache_blocks/pattern_base.py), ``PrunedContext``
(prune_context.py) and ``CachedContextManager.can_cache`` / ``similarity`` (cache_manager.py). Per call:

* begin (``mark_step_begin``): :func:`~dit_passes.cache.decision.start_call`; the per-step diff list starts empty.
* per prunable block ``j``, with ``h`` the image stream entering it, first match wins:
  warm-up -> compute; mask slot 1 -> compute, slot 0 with "static" -> prune; cached steps (this one included
  once a block of it was pruned) ``>= max_cached_steps`` -> compute; the run of cached steps before this step
  ``>= max_continuous_cached_steps`` -> compute; threshold ``<= 0`` -> compute; nothing stored for block j ->
  compute; else prune iff ``mean|in_j - h| / mean|in_j| < threshold`` (``-1`` recorded and prune when the
  threshold is ``>= 1``). The threshold is ``residual_diff_threshold``, raised by the dynamic rule (see
  :class:`~dit_passes.cache.config.DBPruneConfig`) from the diffs recorded earlier in this step.
  ``max_accumulated_residual_diff_threshold`` has no effect: the reference's pruned context never
  accumulates diffs.
* a pruned block adds its stored residuals to its entering streams; a computed one stores its input
  (``in_j``) and its residuals. The first pruned block of a step counts the step as cached.

With a calibrator (TaylorSeer / FoCa / DMD; the reference's ``set_Bn_buffer`` / ``apply_prune`` through the context's
calibrator, one state per block and stream named after the block): a computed block feeds its residuals to its own
calibrator state instead of storing them, a pruned one adds the calibrator's forecast of them (formed in the pruned
arm only; FoCa moves the forecast into its rolling pair). The forecast's elapsed steps count from that block's last
computed step; the calibrator's step frame is the context's, as DBCache's (the reference creates every block's state at
the generation's first call, where every block computes). The decision itself is unchanged: it compares block inputs, never the forecast. With
``force_reduce_calibrator_vram=True`` the reference downsamples what the decision compares (``in_j`` stored and ``h``
compared as ``[..., ::4]``), so here too. The image stream is the calibrator's stream 0 (``enable_calibrator``), the
block's other streams the encoder ones (``enable_encoder_calibrator``).

State (graph inputs / outputs, per cache context): the DBCache scalars (:data:`~dit_passes.cache.state.SCALARS`),
per block ``in{j}`` / ``in{j}_valid`` and ``b{j}_<stream entries>`` (:func:`~dit_passes.cache.state.stream_keys` of
each stream, image first: ``b{j}_res{g}``, or the calibrator's entries and ``b{j}_last_compute_step``), and this
call's ``block_pruned`` / ``block_diffs`` (one entry per prunable block, NaN where no diff was recorded) for reports.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .config import CalibratorConfig, DBPruneConfig
from .decision import _mask_slot_is_one, hit_values, start_call, update_after_branch
from .program import CacheProgram, StateSpec
from .state import SCALARS, stream_keys, stream_spec
from .stats import CFG_CONTEXTS, diff_statistics
from .store import CacheStore

# how many of a step's recorded diffs the dynamic threshold averages (the reference's ``[:5]``)
DYNAMIC_WINDOW = 5
# per-call temporaries threaded from block to block: diffs recorded, and the positive ones among the first five
STEP_KEYS = ("n_diffs", "pos_sum", "pos_count")
# the reference's prune fields of a summary (``CacheStats``), per context
PRUNE_FIELDS = ("pruned_steps", "pruned_blocks", "actual_blocks", "pruned_ratio")
# ``force_reduce_calibrator_vram``: the reference's ``downsample_factor`` floor for the compared block inputs
REDUCED_VRAM_DOWNSAMPLE = 4
LAST_COMPUTE = "last_compute_step"


def calibrator_order(image: int, streams: int) -> List[int]:
    """The block's leaving streams (indices) in the calibrator's order: the image stream first (stream 0)."""
    return [image] + [k for k in range(streams) if k != image]


def _stream_entries(calibrator: Optional[CalibratorConfig], streams: int) -> List[str]:
    """One block's per-stream entries in calibrator order (unprefixed), and its last computed step if calibrated."""
    out = [k for g in range(streams) for k in stream_keys(g, calibrator)]
    return out + ([LAST_COMPUTE] if calibrator is not None else [])


@dataclasses.dataclass(eq=False, kw_only=True)
class DBPruneProgram(CacheProgram):
    """The state and the per-block rule of one graph. ``blocks``: the prunable block indices, in order;
    ``block_streams[i]``: how many streams block ``blocks[i]`` caches a residual for."""

    config: DBPruneConfig
    blocks: Tuple[int, ...]
    block_streams: Tuple[int, ...]
    total_blocks: int  # every block of the range, pruned or not (the reference's ``actual_blocks`` per call)
    calibrator: Optional[CalibratorConfig] = None
    image_streams: Tuple[int, ...] = ()  # per block: the index of its image stream among its leaving streams
    downsample: int = 1  # the decision compares ``h[..., ::downsample]``

    @property
    def predicts(self) -> bool:
        """Whether a pruned block adds a forecast (:meth:`block_hit`, in the pruned arm) rather than stored
        residuals."""
        return self.calibrator is not None

    def _entries(self, i: int) -> List[str]:
        return _stream_entries(self.calibrator, self.block_streams[i])

    def residual_keys(self, i: int) -> List[str]:
        """Without a calibrator: block ``blocks[i]``'s stored residuals, one per leaving stream in stream order."""
        order = self._order(i)
        return [f"b{self.blocks[i]}_res{order.index(x)}" for x in range(len(order))]

    def _view(self, i: int, step: torch.Tensor, store: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Block ``blocks[i]``'s stream entries under the names :mod:`~dit_passes.cache.decision` reads (its last
        computed step as ``last_compute_step``), with this call's ``step``."""
        return dict(zip(self._entries(i), store), step=step)

    def _order(self, i: int) -> List[int]:
        return calibrator_order(self.image_streams[i] if self.image_streams else 0, self.block_streams[i])

    # -- the modules the pass inserts ---------------------------------------------------------------------
    def begin_call(self, timestep, flat: Sequence[torch.Tensor]):
        """``(timestep, *scalars, *valid flags) -> (*scalars', *step temporaries, *valid flags')`` at the start of
        the call (scalars in :data:`SCALARS` order, flags in state order)."""
        valid_names = [k for k in self.names if k.endswith("_valid")]
        s = dict(zip(SCALARS, flat[:len(SCALARS)]))
        s.update(zip(valid_names, flat[len(SCALARS):]))
        s, _ = start_call(s, timestep if self.has_timestep else None, self.config)
        s["use_cache"] = torch.zeros_like(s["use_cache"])  # this call's "a block was pruned"
        zero = torch.zeros((), dtype=torch.int64, device=s["step"].device)
        return (*(s[k] for k in SCALARS), zero, zero.to(torch.float64), zero, *(s[k] for k in valid_names))

    def block_decide(self, h: torch.Tensor, flat: Sequence[torch.Tensor], i: int):
        """Block ``blocks[i]``: ``(h, *scalars, *step temporaries, in_j, in_j_valid) -> (prune, diff, *scalars',
        *step temporaries')``. The decision compares block inputs only; a calibrator's forecast is
        :meth:`block_hit`'s."""
        cfg = self.config
        n = len(SCALARS)
        s = dict(zip(SCALARS, flat[:n]))
        tmp = dict(zip(STEP_KEYS, flat[n:n + 3]))
        prev, valid = flat[n + 3], flat[n + 4]
        h = h[..., ::self.downsample] if self.downsample > 1 else h
        step = s["step"]
        dev = step.device
        false = torch.zeros((), dtype=torch.bool, device=dev)
        decided, result = false, false

        def settle(cond: torch.Tensor, value: bool) -> None:
            nonlocal decided, result
            if value:
                result = result | (~decided & cond)
            decided = decided | cond

        w = cfg.warmup_limit()
        if w > 0:
            settle((step < w) & (step % cfg.warmup_interval == 0), False)
        if cfg.steps_computation_mask is not None:
            settle(_mask_slot_is_one(cfg.steps_computation_mask, step), False)
            if cfg.steps_computation_policy == "static":
                settle(~false, True)
        this_step_cached = s["last_cached_step"] == step
        if cfg.max_cached_steps >= 0:
            settle(s["cached_count"] >= cfg.max_cached_steps, False)
        if cfg.max_continuous_cached_steps >= 0:
            # the limit counts earlier steps: a hit already recorded for this step is not one of them
            settle((s["continuous"] - this_step_cached.to(torch.int64)) >= cfg.max_continuous_cached_steps, False)
        threshold = torch.full((), float(cfg.residual_diff_threshold), dtype=torch.float64, device=dev)
        if cfg.enable_dynamic_prune_threshold:
            relaxed = tmp["pos_sum"] / tmp["pos_count"].clamp(min=1) * cfg.dynamic_prune_threshold_relax_ratio
            cap = (2 * float(cfg.residual_diff_threshold) if cfg.max_dynamic_prune_threshold is None
                   else float(cfg.max_dynamic_prune_threshold))
            raise_it = (tmp["pos_count"] > 0) & (relaxed < cap) & (relaxed > threshold)
            threshold = torch.where(raise_it, relaxed, threshold)
        settle(threshold <= 0.0, False)
        settle(valid == 0, False)

        record = ~decided  # the call reaches `similarity`
        num = (prev - h.to(prev.dtype)).abs().mean()
        den = prev.abs().mean()
        measured = (num / den).to(torch.float64)
        always = threshold >= 1.0
        diff = torch.where(always, -1.0, measured)
        prune = torch.where(record, always | (diff < threshold), result)

        # -- bookkeeping ------------------------------------------------------------------------------------
        first_hit = prune & ~this_step_cached
        s["cached_count"] = s["cached_count"] + first_hit
        s["continuous"] = s["continuous"] + first_hit
        s["last_cached_step"] = torch.where(prune, step, s["last_cached_step"])
        first_diff = record & (s["diff_step"] != step)
        s["diff"] = torch.where(first_diff, diff, s["diff"])
        s["diff_step"] = torch.where(first_diff, step, s["diff_step"])
        counted = record & (tmp["n_diffs"] < DYNAMIC_WINDOW) & (diff > 0.0)
        tmp["pos_sum"] = torch.where(counted, tmp["pos_sum"] + diff, tmp["pos_sum"])
        tmp["pos_count"] = tmp["pos_count"] + counted
        tmp["n_diffs"] = tmp["n_diffs"] + record
        s["use_cache"] = s["use_cache"] | prune
        out_diff = torch.where(record, diff, float("nan"))
        return (prune, out_diff, *(s[k] for k in SCALARS), *(tmp[k] for k in STEP_KEYS))

    def block_hit(self, flat: Sequence[torch.Tensor], i: int) -> List[torch.Tensor]:
        """With a calibrator, block ``blocks[i]``: ``(step, *stream entries) -> (*forecasts)``, the forecast of the
        block's residuals (one per leaving stream, in stream order: what a pruned block adds). The pass calls it in
        the cond's pruned arm only, so a computed block forms no forecast."""
        order = self._order(i)
        forecast = hit_values(self._view(i, flat[0], flat[1:]), len(order), self.calibrator)
        return [forecast[order.index(x)] for x in range(len(order))]

    def block_commit(self, prune: torch.Tensor, h: torch.Tensor, flat: Sequence[torch.Tensor], i: int):
        """``(prune, h, step, *new_values, in_j, in_j_valid, *stream entries) -> (in_j', in_j_valid', *entries')``:
        ``new_values`` (stream order) are the block's residuals where it computed, what the cached arm added where
        it was pruned. A computed block stores its input and its residuals (or advances its calibrator states); a
        pruned one keeps them (FoCa's rolling pair takes the forecast)."""
        k = self.block_streams[i]
        step, new, prev, valid, old = flat[0], flat[1:1 + k], flat[1 + k], flat[2 + k], flat[3 + k:]
        compute = ~prune
        h = h[..., ::self.downsample] if self.downsample > 1 else h
        head = (torch.where(compute, h.to(prev.dtype), prev), torch.where(compute, 1, valid))
        order = self._order(i)
        if not self.predicts:  # entry g is the residual of stream order[g]
            return (*head, *(torch.where(compute, new[x].to(o.dtype), o) for x, o in zip(order, old)))
        after = update_after_branch(self._view(i, step, old), prune, [new[x] for x in order], self.calibrator)
        return (*head, *(after[e] for e in self._entries(i)))

    @staticmethod
    def finish_call(flat: Sequence[torch.Tensor]):
        """``(*prune_i, *diff_i) -> (block_pruned, block_diffs)``: this call's per-block record."""
        half = len(flat) // 2
        return torch.stack(list(flat[:half])), torch.stack(list(flat[half:]))


class _Call(torch.nn.Module):
    """A module calling one of the program's methods (what the graph's ``call_module`` nodes name)."""

    def __init__(self, fn, *extra):
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, *args):
        return self.fn(*args, *self.extra)


class Begin(_Call):
    def forward(self, timestep, *flat):
        return self.fn(timestep, flat)


class BlockDecide(_Call):
    def forward(self, h, *flat):
        return self.fn(h, flat, *self.extra)


class BlockHit(_Call):
    def forward(self, *flat):
        return tuple(self.fn(flat, *self.extra))


class BlockCommit(_Call):
    def forward(self, prune, h, *flat):
        return self.fn(prune, h, flat, *self.extra)


class Finish(_Call):
    def forward(self, *flat):
        return self.fn(flat)


def check_calibrator(calibrator: Optional[CalibratorConfig]) -> None:
    """Refuse a calibrator DBPrune cannot take, saying what to use."""
    if calibrator is not None and not isinstance(calibrator, CalibratorConfig):
        raise TypeError(f"DBPrune: calibrator must be a TaylorSeerCalibratorConfig, FoCaCalibratorConfig or "
                        f"DMDCalibratorConfig (dit_passes.cache.config; enable_cache converts cache-dit's), got "
                        f"{type(calibrator).__name__}")
    if calibrator is not None and calibrator.calibrator_cache_type != "residual":
        # the reference stores an encoder stream's residual under its hidden-states name and uses it as the stream
        raise ValueError(f"DBPrune: {type(calibrator).__name__}(calibrator_cache_type="
                         f"{calibrator.calibrator_cache_type!r}) is not supported (the reference then replaces an "
                         "encoder stream by the forecast of its residual); use calibrator_cache_type='residual' "
                         "(the default)")


def build_prune_program(config: DBPruneConfig, *, total_blocks: int, blocks: Sequence[int],
                        inputs: Sequence[torch.Tensor], residuals: Sequence[Sequence[torch.Tensor]],
                        has_timestep: bool, calibrator: Optional[CalibratorConfig] = None,
                        image_streams: Optional[Sequence[int]] = None) -> DBPruneProgram:
    """The program for one graph. ``inputs[i]``: the image stream entering block ``blocks[i]`` (real or fake,
    for shapes); ``residuals[i]``: one example per stream that block leaves; ``image_streams[i]``: which of them
    is the image stream (default: the first)."""
    check_calibrator(calibrator)
    images = tuple(image_streams) if image_streams is not None else (0,) * len(blocks)
    down = REDUCED_VRAM_DOWNSAMPLE if calibrator is not None and config.force_reduce_calibrator_vram else 1
    specs = [StateSpec(k, (), dt, v) for k, (dt, v) in SCALARS.items()]
    for j, h, res, image in zip(blocks, inputs, residuals, images):
        shape = (*h.shape[:-1], -(-h.shape[-1] // down))  # h[..., ::down]
        specs.append(StateSpec(f"in{j}", tuple(shape), h.dtype))
        specs.append(StateSpec(f"in{j}_valid", (), torch.int64))
        for g, x in enumerate(calibrator_order(image, len(res))):
            specs += [StateSpec(f"b{j}_{name}", shape_, dt, fill)
                      for name, (shape_, dt, fill) in stream_spec(calibrator, g, res[x]).items()]
        if calibrator is not None:
            specs.append(StateSpec(f"b{j}_{LAST_COMPUTE}", (), torch.int64, -1))
    specs.append(StateSpec("block_pruned", (len(blocks),), torch.bool))
    specs.append(StateSpec("block_diffs", (len(blocks),), torch.float64, float("nan")))
    return DBPruneProgram(config=config, blocks=tuple(blocks), block_streams=tuple(len(r) for r in residuals),
                          total_blocks=total_blocks, calibrator=calibrator, image_streams=images, downsample=down,
                          state_spec=specs, num_streams=0, has_timestep=has_timestep,
                          separate_cfg=bool(config.enable_separate_cfg), cfg_compute_first=config.cfg_compute_first)


def block_state_keys(program: DBPruneProgram, i: int) -> List[str]:
    """The state names block ``program.blocks[i]`` reads and writes, in the order its modules take them:
    ``in{j}``, ``in{j}_valid``, then its stream entries."""
    j = program.blocks[i]
    return [f"in{j}", f"in{j}_valid"] + [f"b{j}_{e}" for e in program._entries(i)]


class PruneStore(CacheStore):
    """The :class:`CacheStore` of a DBPrune graph: also keeps each call's per-block record (pruned flags and
    diffs, device tensors: no sync per call), and its :meth:`summary` adds the reference's prune fields per
    generation and context: ``pruned_steps``, ``pruned_blocks`` / ``actual_blocks`` (per call),
    ``pruned_ratio``, and ``residual_diffs`` as the list of the step's diffs, block by block."""

    def __init__(self, config: DBPruneConfig, stats_capacity: int = 4096):
        super().__init__(config, None, stats_capacity)
        self._blocks: List[Optional[Tuple[int, torch.Tensor]]] = [None] * stats_capacity
        self._calls = 0

    def outputs(self, graph_id: int, context: str, values: Sequence[torch.Tensor]) -> None:
        super().outputs(graph_id, context, values)
        program = self._programs[graph_id][0]
        rec = self.view(graph_id, values, ("block_pruned", "block_diffs"))  # the branch this call ran
        row = torch.cat([rec["block_pruned"].to(torch.float64), rec["block_diffs"]])
        self._blocks[self._calls % len(self._blocks)] = (getattr(program, "inner", program).total_blocks, row)
        self._calls += 1

    def summary(self) -> List[Dict[str, Any]]:
        gens = super().summary()
        by_gen = {g["generation"]: g for g in gens}
        kept = min(self._calls, len(self._blocks))
        order = [(self._calls - kept + i) % len(self._blocks) for i in range(kept)]
        rows = [(self._blocks[p][0], self._blocks[p][1].cpu().tolist()) for p in order]  # the one sync
        for r, (total, row) in zip(self.stats.records(), rows):
            c = by_gen[r["generation"]]["contexts"][r["context"]]
            if "pruned_blocks" not in c:
                c.update(pruned_blocks=[], actual_blocks=[], residual_diffs={})
            half = len(row) // 2
            c["pruned_blocks"].append(int(sum(row[:half])))
            c["actual_blocks"].append(total)
            diffs = [d for d in row[half:] if d == d]
            if diffs:
                c["residual_diffs"][str(r["step"])] = diffs
        for g in gens:
            for c in g["contexts"].values():
                c["pruned_steps"] = list(c["cached_steps"])
                actual = sum(c.get("actual_blocks", ()))
                c["pruned_ratio"] = sum(c["pruned_blocks"]) / actual if c.get("pruned_blocks") and actual else None
                c["residual_diff_stats"] = diff_statistics([d for v in c.get("residual_diffs", {}).values() for d in v])
            for prefix, names in (("", [n for n in g["contexts"] if n not in CFG_CONTEXTS]),
                                  ("cfg_", [n for n in g["contexts"] if n in CFG_CONTEXTS])):
                if len(names) == 1:
                    c = g["contexts"][names[0]]
                    for k in PRUNE_FIELDS + ("residual_diffs", "residual_diff_stats"):
                        g[prefix + k] = c.get(k)
        return gens

    def fidelity_stats(self) -> Dict[str, Any]:
        """The last generation's decisions and the fraction of block work executed (blocks run / blocks)."""
        out = self.last_generation()
        if out["step_cached"]:
            contexts = self.summary()[-1]["contexts"].values()
            actual = sum(sum(c.get("actual_blocks", ())) for c in contexts)
            pruned = sum(sum(c.get("pruned_blocks", ())) for c in contexts)
            out["executed_block_fraction"] = 1.0 - pruned / actual if actual else 1.0
            out["cached_steps"] = sum(out["step_cached"])
        return out


def last_pruned(store, context: str = "default") -> Dict[str, list]:
    """The last call's per-block record kept by ``store`` (a CacheStore) for ``context``:
    ``{"blocks", "pruned", "diffs"}`` (one sync; for reports and tests; diffs None where none was recorded)."""
    program, state = store.state_of(context)
    return {"blocks": list(program.blocks), "pruned": state["block_pruned"].tolist(),
            "diffs": [None if d != d else d for d in state["block_diffs"].tolist()]}


__all__ = ["DBPruneProgram", "PruneStore", "PRUNE_FIELDS", "build_prune_program", "block_state_keys", "last_pruned",
           "STEP_KEYS", "check_calibrator", "calibrator_order"]
