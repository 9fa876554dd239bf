"""diffusers 0.42's attention-reuse caches as device-side modules: Pyramid Attention Broadcast and FasterCache.

Both hooks sit on attention modules (``diffusers/hooks/pyramid_attention_broadcast.py``, ``faster_cache.py``) and
count the calls since the pipeline last reset them (``iteration``, the same for every module: each runs once
per call). ``t`` is the pipeline's timestep (here: the transformer's ``timestep`` input x ``timestep_scale``).
Ranges are open intervals ``low < t < high``. The rules we reproduce, per kind of attention module:

**PAB**: a call computes iff nothing is stored, or ``iteration == 0``, or ``t`` is outside the kind's range, or
``iteration % block_skip_range == 0``; otherwise the module returns its stored output. The output of every call
is stored.

**FasterCache**: a call skips iff ``t`` is inside the kind's range, ``iteration`` is not a positive multiple of
``block_skip_range``, and the model is guidance distilled or this call approximates its unconditional half
(below); a skipped module returns ``y1 + (y1 - y2) * w`` from its last two stored outputs ``y2, y1`` (both the
first output after a reset). What is stored is the conditional half of the output (its second half in a batched
CFG call) or, guidance distilled, the whole output. diffusers raises when a call would skip with nothing stored;
here it computes. **CFG part** (not distilled; the call is batched CFG, unconditional half first): a call with
``iteration > 0``, ``t`` inside ``unconditional_batch_timestep_skip_range`` and ``iteration`` not a multiple of
``unconditional_batch_skip_range`` approximates the unconditional half of the output from the conditional half:
the stored low / high frequency deltas (fft2 over the last two dims, shifted over all dims, a disc of radius
``min(H, W) // 5`` around the centre is "low") are scaled by ``alpha_low_frequency`` / ``alpha_high_frequency``
while ``t`` is inside their update ranges (1.0 outside; the scaled deltas are stored), added to the conditional
half's bands, and transformed back; every other call measures the deltas (unconditional - conditional bands).
diffusers runs the transformer on the conditional half alone on those calls; the graph, captured at the CFG
batch, runs both halves and replaces the unconditional one (same outputs; the attention modules are skipped, the
rest of the model's work on the unconditional half is not saved).

State per cache context (diffusers keeps one state per hook, shared by every context). The decision is one
module per call (:class:`AttentionReuseDecide`); the per-site values pass through the ``torch.cond`` arms the pass
builds and :class:`FasterSiteUpdate`; :class:`FrequencyGuidance` is the CFG part.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .peer_rules import _scalar_specs, begin_call
from .program import CacheProgram, StateSpec
from .store import CacheStore


@dataclasses.dataclass(frozen=True)
class SiteKind:
    """One kind of attention module (spatial / temporal / cross): its skip range, timestep range, site count."""
    name: str
    block_skip_range: int
    low: float
    high: float
    sites: int


@dataclasses.dataclass(eq=False, kw_only=True)
class AttentionReuseProgram(CacheProgram):
    """The scalars (:func:`_scalar_specs` plus ``attn_run``: attention modules computed this generation), then
    per site and output its stored values (``stored_names``), then FasterCache's frequency deltas."""

    config: Any
    rule: str = "pab"  # "pab" | "faster"
    kinds: Tuple[SiteKind, ...] = ()
    per_output: Tuple[str, ...] = ("last",)  # FasterCache: ("prev", "last")
    site_outputs: Tuple[int, ...] = ()
    cfg_half: bool = False  # FasterCache's CFG part: the graph's batch is (uncond, cond)

    num_scalars: int = 0

    @property
    def scalar_names(self) -> Tuple[str, ...]:
        return self.names[:self.num_scalars]

    def stored_names(self, site: int, which: str) -> List[str]:
        return [f"s{site}_{j}_{which}" for j in range(self.site_outputs[site])]

    @property
    def num_sites(self) -> int:
        return sum(k.sites for k in self.kinds)


def build_attention_program(config: Any, rule: str, kinds: Sequence[SiteKind], site_values: Sequence[Sequence],
                            has_timestep: bool, cfg_half: bool = False, delta_shape: Tuple[int, ...] = ()
                            ) -> AttentionReuseProgram:
    """``site_values[s]``: example outputs of site ``s`` (kinds' sites in order); with ``cfg_half`` only the
    conditional half (batch / 2) is stored. ``delta_shape``: FasterCache's frequency deltas (CFG part) or ()."""
    per_output = ("last",) if rule == "pab" else ("prev", "last")
    specs = _scalar_specs({"attn_run": (torch.int64, 0)})
    for s, outs in enumerate(site_values):
        for which in per_output:
            for j, y in enumerate(outs):
                shape = (y.shape[0] // 2, *y.shape[1:]) if cfg_half else tuple(y.shape)
                specs.append(StateSpec(f"s{s}_{j}_{which}", tuple(shape), y.dtype))
    if delta_shape:
        specs += [StateSpec(f"d_{band}", tuple(delta_shape), torch.complex64) for band in ("low", "high")]
    return AttentionReuseProgram(config=config, state_spec=specs, num_streams=0, has_timestep=has_timestep,
                                 reads_fn_residual=False, rule=rule, kinds=tuple(kinds), per_output=per_output,
                                 site_outputs=tuple(len(v) for v in site_values), cfg_half=cfg_half,
                                 num_scalars=len(_scalar_specs({"attn_run": (torch.int64, 0)})))


def _inside(t: torch.Tensor, bounds: Tuple[float, float]) -> torch.Tensor:
    return (t > bounds[0]) & (t < bounds[1])


class AttentionReuseDecide(torch.nn.Module):
    """``(timestep, *scalars) -> (skip_uncond, w_low, w_high, first, *reuse_per_kind, any_reused, diff, *scalars')``:
    ``reuse_per_kind[k]``: the sites of kind ``k`` reuse this call; ``first``: nothing stored before this call;
    ``skip_uncond`` / ``w_*``: FasterCache's CFG part (False / 1.0 otherwise)."""

    def __init__(self, program: AttentionReuseProgram):
        super().__init__()
        self.program = program

    def forward(self, timestep: torch.Tensor, *flat: torch.Tensor):
        p, cfg = self.program, self.program.config
        names = p.scalar_names
        s = begin_call(dict(zip(names, flat)), p.state_spec[:len(names)], timestep)
        step, stored = s["step"], s["has_prev"]
        t = timestep.detach().reshape(-1)[0].to(torch.float64) * cfg.timestep_scale
        false = torch.zeros((), dtype=torch.bool, device=step.device)
        one = torch.ones((), dtype=torch.float64, device=step.device)
        skip_uncond, w_low, w_high = false, one, one
        if p.rule == "faster" and not cfg.is_guidance_distilled:
            skip_uncond = ((step > 0) & _inside(t, cfg.unconditional_batch_timestep_skip_range)
                           & (torch.remainder(step, cfg.unconditional_batch_skip_range) != 0))
            w_low = torch.where(_inside(t, cfg.low_frequency_weight_update_timestep_range), cfg.alpha_low_frequency,
                                one)
            w_high = torch.where(_inside(t, cfg.high_frequency_weight_update_timestep_range), cfg.alpha_high_frequency,
                                 one)
        reuse = []
        for k in p.kinds:
            multiple = torch.remainder(step, k.block_skip_range) == 0
            if p.rule == "pab":
                compute = ~stored | (step == 0) | ~_inside(t, (k.low, k.high)) | multiple
                reuse.append(~compute)
            else:
                gate = true_like(false) if cfg.is_guidance_distilled else skip_uncond
                reuse.append(_inside(t, (k.low, k.high)) & ~((step > 0) & multiple) & gate & stored)
        any_reused = torch.stack([*reuse, skip_uncond]).any()
        s["attn_run"] = s["attn_run"] + sum((~r).to(torch.int64) * k.sites for r, k in zip(reuse, p.kinds))
        s["cached_count"] = s["cached_count"] + any_reused
        s["use_cache"] = any_reused
        s["has_prev"] = s["has_prev"] | True
        nan = torch.full((), float("nan"), dtype=torch.float64, device=step.device)
        return (skip_uncond, w_low, w_high, ~stored, *reuse, any_reused, nan, *(s[n] for n in names))


def true_like(x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(x, dtype=torch.bool)


class FasterSiteUpdate(torch.nn.Module):
    """After one site's cond: ``(first, *outputs, *prev, *last) -> (*prev', *last')``: the stored pair moves on by
    this call's output (its conditional half with ``cfg_half``); the first call stores it twice."""

    def __init__(self, num_outputs: int, cfg_half: bool):
        super().__init__()
        self.num_outputs, self.cfg_half = num_outputs, cfg_half

    def forward(self, first: torch.Tensor, *flat: torch.Tensor):
        n = self.num_outputs
        outs, prev, last = flat[:n], flat[n:2 * n], flat[2 * n:]
        kept = [y[y.shape[0] // 2:] if self.cfg_half else y for y in outs]
        return (*(torch.where(first, c, l) for c, l in zip(kept, last)), *kept)


def faster_approximation(weight: float, cfg_half: bool, prev: Sequence[torch.Tensor], last: Sequence[torch.Tensor]):
    """A skipped site's outputs, ``y1 + (y1 - y2) * weight`` (both CFG halves alike: the unconditional half of
    the model's output is replaced afterwards)."""
    outs = []
    for y2, y1 in zip(prev, last):
        a = y1 + (y1 - y2) * weight
        outs.append(torch.cat([a, a], 0) if cfg_half else a)
    return outs


def _frames(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "BCFHW":
        x = x.permute(0, 2, 1, 3, 4)
    return x.flatten(0, 1) if fmt in ("BCFHW", "BFCHW") else x


def _unframes(x: torch.Tensor, fmt: str, batch: int) -> torch.Tensor:
    if fmt in ("BCFHW", "BFCHW"):
        x = x.unflatten(0, (batch, -1))
    return x.permute(0, 2, 1, 3, 4) if fmt == "BCFHW" else x


def delta_shape(out_shape: Sequence[int], fmt: str) -> Tuple[int, ...]:
    """The shape of the frequency deltas for a CFG-batched output of ``out_shape``."""
    half = (out_shape[0] // 2, *out_shape[1:])
    if fmt == "BCFHW":
        return (half[0] * half[2], half[1], *half[3:])
    if fmt == "BFCHW":
        return (half[0] * half[1], *half[2:])
    return tuple(half)


def _bands(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The low / high frequency parts of ``x`` (float32): fft over the last two dims, shifted over all dims,
    low = a disc of radius ``min(H, W) // 5`` around the centre (FasterCache's reference split)."""
    f = torch.fft.fftshift(torch.fft.fft2(x))
    h, w = x.shape[-2:]
    rows = torch.arange(h, device=x.device).reshape(h, 1)
    cols = torch.arange(w, device=x.device).reshape(1, w)
    low = (cols - w // 2) ** 2 + (rows - h // 2) ** 2 <= (min(h, w) // 5) ** 2
    return f * low, f * ~low


class FrequencyGuidance(torch.nn.Module):
    """FasterCache's CFG part after the model: ``(skip_uncond, w_low, w_high, out, d_low, d_high) ->
    (out', d_low', d_high')`` (``out``: the model's first output, unconditional half first)."""

    def __init__(self, tensor_format: str):
        super().__init__()
        self.fmt = tensor_format

    def forward(self, skip_uncond, w_low, w_high, out, d_low, d_high):
        b = out.shape[0] // 2
        uncond, cond = out[:b], out[b:]
        low_c, high_c = _bands(_frames(cond, self.fmt).float())
        low_u, high_u = _bands(_frames(uncond, self.fmt).float())
        s_low, s_high = d_low * w_low, d_high * w_high
        approx = torch.fft.ifft2(torch.fft.ifftshift((s_low + low_c) + (s_high + high_c))).real
        approx = _unframes(approx, self.fmt, b).to(out.dtype)
        new_out = torch.where(skip_uncond, torch.cat([approx, cond], 0), out)
        return (new_out, torch.where(skip_uncond, s_low, low_u - low_c),
                torch.where(skip_uncond, s_high, high_u - high_c))


class AttentionReuseStore(CacheStore):
    """The store of the attention-reuse passes: adds the fraction of attention modules computed."""

    def fidelity_stats(self) -> Dict[str, Any]:
        out = super().fidelity_stats()
        run = total = 0
        for (gid, _ctx), state in self._slots.items():
            program = self._programs[gid][0]
            values = dict(zip(program.names, state))
            run += int(values["attn_run"])
            total += (int(values["step"]) + 1) * program.num_sites
        if total:
            out["executed_attention_fraction"] = run / total
            out["cached_steps"] = sum(out["step_cached"])
        return out


__all__ = ["SiteKind", "AttentionReuseProgram", "build_attention_program", "AttentionReuseDecide",
           "FasterSiteUpdate", "faster_approximation", "delta_shape", "FrequencyGuidance", "AttentionReuseStore"]
