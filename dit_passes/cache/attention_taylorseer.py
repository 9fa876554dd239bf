"""diffusers 0.42's TaylorSeer cache as device-side modules: one step decision, per-site prediction and update.

diffusers' hook (``diffusers/hooks/taylorseer_cache.py``) sits on every attention module and keeps, per module
and cache context, a step counter and Taylor factors ``F_0..F_m`` of each of the module's outputs. Its rule,
which we reproduce:

* step ``i`` (calls of this context, from 0) computes iff ``i < disable_cache_before_step``, or
  ``(i - disable_cache_before_step - 1) mod cache_interval == 0`` (Python's mod), or
  ``i >= disable_cache_after_step`` (when set); every other step predicts.
* a computed step stores ``F_0 = y`` and, while the previous update had factor ``j``,
  ``F_{j+1} = (F_j(new) - F_j(old)) / (i - i_last)`` (in y's dtype; each factor then stored in
  ``taylor_factors_dtype``); the first update of a generation stores ``F_0`` only.
* a predicted step returns ``0 + sum_j F_j * (i - i_last)**j / j!`` over the stored factors (in y's dtype).

All modules of one call share the step, so the decision and the scalars (step, last update, how many
factors are stored) are computed once per call (:class:`TaylorSeerDecide`); the factors are per site
(the cond's predict arm, an ATen graph built by the pass: ``passes/taylorseer_cache._predict_arm``;
:class:`SiteUpdate` after the cond). Generations restart when
the timestep rises again or with ``new_generation()`` (diffusers resets at the end of a pipeline call).
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

from .peer_configs import TaylorSeerCacheConfig
from .peer_rules import _scalar_specs, begin_call
from .program import CacheProgram, StateSpec


@dataclasses.dataclass(eq=False, kw_only=True)
class TaylorSeerProgram(CacheProgram):
    """The state: the shared scalars (``last_compute_step``: the last update's step, ``n_valid``: factors
    stored), then per site and output ``max_order + 1`` factors (``site_outputs[s]`` outputs at site ``s``)."""

    config: TaylorSeerCacheConfig
    site_outputs: Tuple[int, ...] = ()

    @property
    def scalar_names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.state_spec if s.shape == () and not s.name.startswith("f"))

    def factor_names(self, site: int) -> List[str]:
        m = self.config.max_order + 1
        return [f"f{site}_{j}_{o}" for j in range(self.site_outputs[site]) for o in range(m)]


def build_taylorseer_program(config: TaylorSeerCacheConfig, site_values: Sequence[Sequence[torch.Tensor]],
                             has_timestep: bool) -> TaylorSeerProgram:
    """``site_values[s]``: example outputs (real or fake) of attention site ``s``, for the factors' shapes."""
    specs = _scalar_specs({"n_valid": (torch.int64, 0)})
    for s, outs in enumerate(site_values):
        for j, y in enumerate(outs):
            dt = config.taylor_factors_dtype or y.dtype
            specs += [StateSpec(f"f{s}_{j}_{o}", tuple(y.shape), dt) for o in range(config.max_order + 1)]
    return TaylorSeerProgram(config=config, state_spec=specs, num_streams=0, has_timestep=has_timestep,
                             reads_fn_residual=False, site_outputs=tuple(len(v) for v in site_values))


class TaylorSeerDecide(torch.nn.Module):
    """``(timestep, *scalars) -> (use_cache, diff, n_valid, offset, *scalars')``: ``use_cache`` = predict this
    call; ``n_valid`` / ``offset`` (= step - last update, float64) are the values before this call's update,
    for the sites; ``scalars'`` the state after it (the update happens exactly on computed steps)."""

    def __init__(self, program: TaylorSeerProgram):
        super().__init__()
        self.program = program

    def forward(self, timestep: torch.Tensor, *flat: torch.Tensor):
        p, cfg = self.program, self.program.config
        names = p.scalar_names
        s = dict(zip(names, flat))
        s = begin_call(s, p.state_spec[:len(names)], timestep if p.has_timestep else None)
        step = s["step"]
        before = cfg.disable_cache_before_step
        compute = (step < before) | (torch.remainder(step - before - 1, cfg.cache_interval) == 0)
        if cfg.disable_cache_after_step is not None:
            compute = compute | (step >= cfg.disable_cache_after_step)
        use_cache = ~compute
        n_valid, offset = s["n_valid"], (step - s["last_compute_step"]).to(torch.float64)
        s["cached_count"] = s["cached_count"] + use_cache
        s["use_cache"] = use_cache
        grown = torch.where(n_valid == 0, 1, torch.clamp(n_valid + 1, max=cfg.max_order + 1))
        s["n_valid"] = torch.where(compute, grown, n_valid)
        s["has_prev"] = s["has_prev"] | compute
        s["last_compute_step"] = torch.where(compute, step, s["last_compute_step"])
        nan = torch.full((), float("nan"), dtype=torch.float64, device=step.device)
        return (use_cache, nan, n_valid, offset, *(s[n] for n in names))


class SiteUpdate(torch.nn.Module):
    """After the cond at one site: ``(use_cache, n_valid, offset, *outputs, *factors) -> factors'`` (the new
    ladder on computed steps, the old one on predicted steps)."""

    def __init__(self, num_outputs: int, max_order: int):
        super().__init__()
        self.num_outputs, self.orders = num_outputs, max_order + 1

    def forward(self, use_cache: torch.Tensor, n_valid: torch.Tensor, offset: torch.Tensor, *flat: torch.Tensor):
        outs, factors = flat[:self.num_outputs], flat[self.num_outputs:]
        compute = ~use_cache
        delta = offset.to(torch.int64)  # diffusers divides by the integer step gap
        new_factors = []
        for j, y in enumerate(outs):
            ladder = factors[j * self.orders:(j + 1) * self.orders]
            new = [y]
            for o in range(self.orders - 1):
                new.append((new[o] - ladder[o].to(y.dtype)) / delta)
            # entries past the new count keep stale values; SitePredict never reads them
            new_factors += [torch.where(compute, n.to(f.dtype), f) for n, f in zip(new, ladder)]
        return tuple(new_factors)


__all__ = ["TaylorSeerProgram", "build_taylorseer_program", "TaylorSeerDecide", "SiteUpdate"]
