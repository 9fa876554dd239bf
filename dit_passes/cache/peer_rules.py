"""Decision rules of diffusers 0.42's block-range caches, as cache programs (device-side, sync-free).

Each is a :class:`~dit_passes.cache.program.CacheProgram`: the pass inserts its ``decide`` / ``commit``
modules around the shared ``torch.cond`` branch (:mod:`dit_passes.passes.cache_branch`). The semantics
are diffusers' hooks' (``diffusers/hooks/first_block_cache.py``, ``mag_cache.py``), step for step:

**First Block Cache** (``FirstBlockProgram``; the cut is Fn=1, Bn=0). R = the first block's residual.
A call computes when no residual of a computed step is stored yet, else when
``mean|R - R_prev| / mean|R_prev| > threshold`` (in R's dtype, compared in float64 as diffusers'
``.item()``); otherwise it caches (a NaN diff caches, as there). ``R_prev`` and the middle residuals
(tail output - first block output, per stream) are written on computed steps only.

**MagCache** (``MagProgram``; the cut is Fn=0, Bn=0: every block is skipped). At step ``i`` (counted
from the generation's first call, cached calls included) with ``i >= int(retention_ratio * N + 0.5)``:
``ratio *= mag_ratios[i]``, ``steps += 1``, ``err += |1 - ratio|`` (in the ratios' dtype); the call skips
iff a residual is stored, ``err <= threshold`` and ``steps <= max_skip_steps``, else it computes and the
three accumulators restart at (1, 0, 0). A skipped call's image stream is its input + the stored residual
(tail output - head input, image stream only); the other streams pass through unchanged. ``calibrate``:
never skips; each computed step stores ``mean(|res_i| / (|res_{i-1}| + 1e-8))`` over tokens (norms over
the last dim, fp32; 1.0 at step 0) in a table read by :meth:`MagCacheStore.mag_ratios`.

Generations: as diffusers resets its state after ``N`` steps (MagCache) or at the end of a pipeline call,
a generation restarts here after ``num_inference_steps`` calls (MagCache), when the timestep rises again,
or with ``new_generation()``. Per cache context ("cond" / "uncond"), as diffusers' state manager.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .decision import _reset_to, generation_starts, update_after_branch
from .peer_configs import FirstBlockCacheConfig, MagCacheConfig
from .program import CacheProgram, StateSpec
from .state import SCALARS
from .store import CacheStore

# The scalars every peer rule keeps (what CacheStats records, the generation bookkeeping, the commit's).
_COMMON = ("step", "gen", "last_t", "has_prev", "cached_count", "diff", "diff_step", "last_compute_step", "use_cache")
_KEEP_ON_RESET = ("step", "gen", "last_t")  # step is set from the reset itself


def _scalar_specs(extra: Dict[str, Tuple[torch.dtype, float]] = {}) -> List[StateSpec]:
    table = {k: SCALARS[k] for k in _COMMON}
    table.update(extra)
    return [StateSpec(k, (), dt, v) for k, (dt, v) in table.items()]


def begin_call(s: Dict[str, torch.Tensor], scalars: Sequence[StateSpec], timestep: Optional[torch.Tensor],
               num_inference_steps: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """``s`` at the start of a call of a peer rule: a new generation resets every scalar of ``scalars`` to its
    fill (but the step / generation bookkeeping), counts the generation, and sets the step."""
    new_gen, t, calls_done = generation_starts(s, timestep, num_inference_steps)
    keep = ~new_gen
    for spec in scalars:
        if spec.name not in _KEEP_ON_RESET:
            s[spec.name] = _reset_to(s[spec.name], new_gen, keep, spec.fill)
    s["gen"] = s["gen"] + new_gen
    s["step"] = torch.where(new_gen, 0, calls_done)
    if t is not None:
        s["last_t"] = t
    return s


@dataclasses.dataclass(eq=False, kw_only=True)
class _PeerProgram(CacheProgram):
    num_inference_steps: Optional[int] = None  # calls after which a generation restarts

    def _unpack(self, flat: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        return dict(zip(self.names, flat[:len(self.names)]))

    def _begin(self, flat: Sequence[torch.Tensor], timestep) -> Dict[str, torch.Tensor]:
        """The state at the start of this call (:func:`begin_call`; the tensors are written before they are read
        again: ``has_prev`` is reset)."""
        return begin_call(self._unpack(flat), [spec for spec in self.state_spec if spec.shape == ()],
                          timestep if self.has_timestep else None, self.num_inference_steps)

    def _finish(self, s: Dict[str, torch.Tensor], use_cache: torch.Tensor, diff: torch.Tensor,
                recorded: torch.Tensor) -> None:
        """The bookkeeping every rule shares (diff recorded where ``recorded``; counters; R_prev if kept)."""
        s["diff"] = torch.where(recorded, diff, s["diff"])
        s["diff_step"] = torch.where(recorded, s["step"], s["diff_step"])
        s["cached_count"] = s["cached_count"] + use_cache
        s["has_prev"] = s["has_prev"] | ~use_cache
        s["use_cache"] = use_cache

    def _pack(self, s: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        return tuple(s[n] for n in self.names)


@dataclasses.dataclass(eq=False, kw_only=True)
class FirstBlockProgram(_PeerProgram):
    config: FirstBlockCacheConfig

    def decide_call(self, fn_residual, timestep, flat):
        s = self._begin(flat, timestep)
        r_prev, has_prev = s["R_prev"], s["has_prev"]
        num = (fn_residual - r_prev).abs().mean()
        den = r_prev.abs().mean()
        allreduce = self.allreduce_means()
        if allreduce is not None:
            num, den = allreduce(num, den)
        diff = (num / den).to(torch.float64)
        use_cache = has_prev & ~(diff > self.config.threshold)  # diffusers computes iff diff > threshold
        self._finish(s, use_cache, diff, has_prev)
        s["R_prev"] = torch.where(use_cache, r_prev, fn_residual.to(r_prev.dtype))
        hits = [s[f"res{i}"] for i in range(self.num_streams)]
        return (use_cache, torch.where(has_prev, diff, float("nan")), *hits, *self._pack(s))

    def commit_call(self, use_cache, flat):
        values, s = flat[:self.num_streams], self._unpack(flat[self.num_streams:])
        return self._pack(update_after_branch(s, use_cache, values))


def build_first_block_program(config: FirstBlockCacheConfig, *, image_residual: torch.Tensor,
                              stream_residuals: Sequence[torch.Tensor], has_timestep: bool,
                              group=None) -> FirstBlockProgram:
    specs = _scalar_specs() + [StateSpec("R_prev", tuple(image_residual.shape), image_residual.dtype)]
    specs += [StateSpec(f"res{i}", tuple(r.shape), r.dtype) for i, r in enumerate(stream_residuals)]
    return FirstBlockProgram(config=config, state_spec=specs, num_streams=len(stream_residuals),
                             has_timestep=has_timestep, group=group)


@dataclasses.dataclass(eq=False, kw_only=True)
class ImageResidualProgram(_PeerProgram):
    """A rule caching the whole range with one residual, of the image stream (state ``res``); the other
    streams leave the range unchanged on a skipped call (MagCache, TeaCache)."""

    image_stream: int = 0
    passthrough: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...] = ()  # (shape, dtype) of every stream

    def _image_hits(self, s: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        """What a skipped call adds per stream: the stored residual to the image stream, zeros elsewhere."""
        return [s["res"] if i == self.image_stream else torch.zeros(shape, dtype=dt, device=s["res"].device)
                for i, (shape, dt) in enumerate(self.passthrough)]

    def _store_image_residual(self, s: Dict[str, torch.Tensor], compute: torch.Tensor,
                              values: Sequence[torch.Tensor]) -> None:
        s["res"] = torch.where(compute, values[self.image_stream].to(s["res"].dtype), s["res"])
        s["last_compute_step"] = torch.where(compute, s["step"], s["last_compute_step"])


@dataclasses.dataclass(eq=False, kw_only=True)
class MagProgram(ImageResidualProgram):
    config: MagCacheConfig

    def decide_call(self, fn_residual, timestep, flat):
        s = self._begin(flat, timestep)
        step, cfg = s["step"], self.config
        nan = torch.full((), float("nan"), dtype=torch.float64, device=step.device)
        if cfg.calibrate:
            use_cache = torch.zeros((), dtype=torch.bool, device=step.device)
            self._finish(s, use_cache, nan, use_cache)
            diff = nan
        else:
            ratios = s["ratios"]
            # ratios has num_inference_steps entries and the generation restarts after as many calls
            scale = torch.index_select(ratios, 0, step.clamp(0, ratios.shape[0] - 1).reshape(1)).reshape(())
            active = step >= cfg.retention_steps
            ratio = s["acc_ratio"] * scale
            count = s["acc_steps"] + 1
            err = s["acc_err"] + (1.0 - ratio).abs()
            use_cache = active & s["has_prev"] & (err <= cfg.threshold) & (count <= cfg.max_skip_steps)
            restart = active & ~use_cache
            s["acc_ratio"] = torch.where(use_cache, ratio, torch.where(restart, 1.0, s["acc_ratio"]))
            s["acc_steps"] = torch.where(use_cache, count, torch.where(restart, 0, s["acc_steps"]))
            s["acc_err"] = torch.where(use_cache, err, torch.where(restart, 0.0, s["acc_err"]))
            diff = torch.where(active, err.to(torch.float64), nan)  # the accumulated error stands for the diff
            self._finish(s, use_cache, diff, active)
        return (use_cache, diff, *self._image_hits(s), *self._pack(s))

    def commit_call(self, use_cache, flat):
        values, s = flat[:self.num_streams], self._unpack(flat[self.num_streams:])
        compute, res = ~use_cache, values[self.image_stream]
        if self.config.calibrate:
            # the residual's per-token magnitude against the last computed step's (1.0 with none stored)
            ratio = (torch.linalg.vector_norm(res.float(), dim=-1)
                     / (torch.linalg.vector_norm(s["res"].float(), dim=-1) + 1e-8)).mean()
            if self.group is not None and self.group.size() > 1:  # token shards of equal size: the mean of means
                from ..parallel.collectives import all_reduce
                ratio = all_reduce(ratio.reshape(1), self.group, "avg").reshape(())
            ratio = torch.where(s["last_compute_step"] >= 0, ratio.to(torch.float64), 1.0)
            written = torch.index_put(s["calib"], (s["step"].reshape(1),), ratio.reshape(1))
            s["calib"] = torch.where(compute, written, s["calib"])
        self._store_image_residual(s, compute, values)
        return self._pack(s)


def build_mag_program(config: MagCacheConfig, *, image_stream: int, image_residual: torch.Tensor,
                      stream_residuals: Sequence[torch.Tensor], has_timestep: bool, group=None) -> MagProgram:
    values, dt = config.ratio_table()
    n = config.num_inference_steps
    specs = _scalar_specs({"acc_ratio": (dt, 1.0), "acc_err": (dt, 0.0), "acc_steps": (torch.int64, 0)})
    img = stream_residuals[image_stream]
    specs += [StateSpec("ratios", (n,), dt, values=values), StateSpec("calib", (n,), torch.float64),
              StateSpec("res", tuple(img.shape), img.dtype)]
    return MagProgram(config=config, state_spec=specs, num_streams=len(stream_residuals), has_timestep=has_timestep,
                      group=group, reads_fn_residual=False, num_inference_steps=n, image_stream=image_stream,
                      passthrough=tuple((tuple(r.shape), r.dtype) for r in stream_residuals))


class MagCacheStore(CacheStore):
    """The MagCache pass's store: the cache state per context, plus the calibrated ratios."""

    def mag_ratios(self, context: Optional[str] = None) -> List[float]:
        """The magnitude ratios the last calibration generation measured (``MagCacheConfig(calibrate=True)``),
        one per step, for ``MagCacheConfig(mag_ratios=...)``; ``context``: the cache context (default: the
        only one, or "cond")."""
        if not self.config.calibrate:
            raise RuntimeError("mag_ratios(): this MagCache was not built with calibrate=True")
        keys = [k for k in self._slots if context is None or k[1] == context]
        if context is None and len({k[1] for k in keys}) > 1:
            keys = [k for k in keys if k[1] == "cond"] or keys
        if not keys:
            raise RuntimeError(f"mag_ratios(): no calibration run recorded (context {context!r}); run the "
                               f"pipeline once first")
        key = keys[-1]
        program = self._programs[key[0]][0]
        state = dict(zip(program.names, self._slots[key]))
        done = int(state["step"]) + 1
        return [float(x) for x in state["calib"][:done].tolist()]


__all__ = ["FirstBlockProgram", "ImageResidualProgram", "MagProgram", "build_first_block_program", "build_mag_program", "MagCacheStore"]
