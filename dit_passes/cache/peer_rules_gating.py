"""Decision rules of the accumulated-distance gates, as cache programs (device-side, sync-free).

Both skip the whole block range (the cut is Fn=0, Bn=0: a skipped call's image stream is its input + a
stored residual of the range) and both accumulate a per-step distance until it reaches a threshold. They
differ in what the distance is measured on and what a skip adds.

**SeaCache** (``SeaProgram``; diffusers 0.42's ``hooks/sea_cache.py``, generic leader / tail path). The
indicator of a call is the transformer's ``hidden_states`` input seen as one ``(T, H, W, C)`` latent per
sample (5-D ``[B, C, T, H, W]``: diffusers' Wan adapter; 4-D ``[B, C, H, W]``: T=1; 3-D ``[B, L, D]``: a
square ``sqrt(L) x sqrt(L)`` token grid, T=1, ours: diffusers has no adapter there and never caches),
filtered in fp32 by ``ifftn(fftn(x) * g).real`` over (T, H, W), where ``g`` is the product over the axes of
``a P / (a^2 P + s^2 + 1e-16)``, ``P = 1 / (|f|^power_exp + 1e-16)``, ``s = clamp(sigma, 1e-6, 1 - 1e-6)``,
``a = 1 - s``, normalised to unit mean. At step ``i`` of ``N``: the call computes if ``i < retention_steps``,
``i >= N - cache_end_steps``, no indicator is stored, ``consecutive >= max_consecutive_cached`` (when > 0),
or ``acc + d >= threshold`` with ``d`` the mean over samples of ``mean|ind - ind_prev| / (mean|ind_prev| +
1e-16)`` (fp32, summed in float64); it also computes when no residual is stored. ``acc`` becomes 0 on a
computed call, ``acc + d`` on a skipped one; the indicator is stored on every call. A computed call
appends ``(i, residual)`` to a history of ``residual_order + 1`` entries; a skip adds the latest residual
or, with two entries at steps ``j < k``, ``r_k + (r_k - r_j) * (i - k) / (k - j)``. Streams other than the
image stream add their last computed residual (diffusers returns the stored stream itself: the same value
when the stream enters the range unchanged from call to call, as the text stream does).

**TeaCache** (``TeaProgram``; the paper's rule, no diffusers hook). ``m`` = the first block's
timestep-modulated input (``LN(x) * (1 + scale) + shift``), given by the pass. ``rel = mean|m - m_prev| /
mean|m_prev|`` (averaged over a parallel group's shards); the first and the last of ``N`` steps compute and
set ``acc = 0``; otherwise ``acc += poly(rel)`` (float64) and the call skips iff ``acc < threshold`` (and a
residual is stored), else it computes and sets ``acc = 0``. ``m_prev = m`` on every call. A skip adds the
last computed residual to the image stream; other streams pass through unchanged (as MagCache's).

Generations restart as for the other peer rules (:func:`~dit_passes.cache.peer_rules.begin_call`), per
cache context.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from .decision import _timestep_value
from .peer_configs_gating import SeaCacheConfig, TeaCacheConfig
from .peer_rules import ImageResidualProgram, _PeerProgram, _scalar_specs
from .program import StateSpec


def sea_latents(hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` as ``[B, T, H, W, C]`` latents (see the module docstring), or ValueError."""
    x = hidden_states
    if x.dim() == 5:
        return x.permute(0, 2, 3, 4, 1)
    if x.dim() == 4:
        return x.permute(0, 2, 3, 1).unsqueeze(1)
    if x.dim() == 3:
        side = math.isqrt(x.shape[1])
        if side * side == x.shape[1]:
            return x.reshape(x.shape[0], 1, side, side, x.shape[2])
    raise ValueError(f"hidden_states of shape {tuple(x.shape)}: expected [B, C, T, H, W], [B, C, H, W] "
                     f"or [B, L, D] with L a square (a token grid)")


def sea_indicator(latents: torch.Tensor, sigma: torch.Tensor, power_exp: float) -> torch.Tensor:
    """The SEA-filtered latents ``[B, T, H, W, C]`` (fp32 in, the input's dtype out)."""
    dtype, x = latents.dtype, latents.contiguous().float()
    dims = (1, 2, 3)
    noise = sigma.clamp(1e-6, 1.0 - 1e-6)
    signal = 1.0 - noise
    gain = None
    for ax in dims:
        f = torch.fft.fftfreq(x.shape[ax], device=x.device, dtype=torch.float32)
        clean = 1.0 / (f.abs().pow(power_exp) + 1e-16)
        g = signal * clean / (signal ** 2 * clean + noise ** 2 + 1e-16)
        shape = [1] * x.dim()
        shape[ax] = -1
        gain = g.reshape(shape) if gain is None else gain * g.reshape(shape)
    mean = gain.mean()
    gain = torch.where(torch.isfinite(mean) & (mean > 0), gain / mean, gain)  # SeaCache's Eq. (7)
    return torch.fft.ifftn(torch.fft.fftn(x, dim=dims) * gain, dim=dims).real.to(dtype)


@dataclasses.dataclass(eq=False, kw_only=True)
class SeaProgram(_PeerProgram):
    config: SeaCacheConfig
    image_stream: int = 0

    def decide_call(self, hidden_states, timestep, flat):
        s = self._begin(flat, timestep)
        cfg, step = self.config, s["step"]
        t = _timestep_value(timestep, step)
        sigma = t / cfg.timestep_scale if t is not None else torch.zeros((), dtype=torch.float64, device=step.device)
        ind = sea_indicator(sea_latents(hidden_states), sigma, cfg.power_exp)
        prev = s["ind"]
        num = (ind.float() - prev.float()).abs().flatten(1).mean(1)
        per_sample = num / (prev.float().abs().flatten(1).mean(1) + 1e-16)  # one relative L1 per sample
        dist = per_sample.to(torch.float64).mean()
        forced = (step < cfg.retention_steps) | ~s["has_ind"]
        if cfg.cache_end_steps:
            forced = forced | (step >= cfg.num_inference_steps - cfg.cache_end_steps)
        if cfg.max_consecutive_cached:
            forced = forced | (s["consecutive"] >= cfg.max_consecutive_cached)
        candidate = s["acc"] + dist
        compute = forced | ~torch.isfinite(candidate) | (candidate >= cfg.threshold) | (s["n_hist"] == 0)
        use_cache = ~compute
        s["acc"] = torch.where(compute, 0.0, candidate)
        s["consecutive"] = torch.where(use_cache, s["consecutive"] + 1, 0)
        s["ind"], s["has_ind"] = ind.to(prev.dtype), torch.ones_like(s["has_ind"])
        nan = torch.full((), float("nan"), dtype=torch.float64, device=step.device)
        diff = torch.where(forced, nan, candidate)  # the accumulated distance stands for the diff
        self._finish(s, use_cache, diff, ~forced)
        hits = [s[f"res{i}"] for i in range(self.num_streams)]
        if self.config.residual_order == 1:
            k, j = s["hist_step"], s["hist_step_prev"]
            scale = ((step - k).to(torch.float64) / (k - j).clamp(min=1).to(torch.float64))
            latest = hits[self.image_stream]
            extrapolated = latest + (latest - s["res_prev"]) * scale.to(latest.dtype)
            hits[self.image_stream] = torch.where((s["n_hist"] >= 2) & (k != j), extrapolated, latest)
        return (use_cache, diff, *hits, *self._pack(s))

    def commit_call(self, use_cache, flat):
        values, s = flat[:self.num_streams], self._unpack(flat[self.num_streams:])
        compute = ~use_cache
        img = f"res{self.image_stream}"
        if self.config.residual_order == 1:
            s["res_prev"] = torch.where(compute, s[img], s["res_prev"])
            s["hist_step_prev"] = torch.where(compute, s["hist_step"], s["hist_step_prev"])
        for i, v in enumerate(values):
            s[f"res{i}"] = torch.where(compute, v.to(s[f"res{i}"].dtype), s[f"res{i}"])
        s["hist_step"] = torch.where(compute, s["step"], s["hist_step"])
        s["n_hist"] = torch.where(compute, (s["n_hist"] + 1).clamp(max=self.config.residual_order + 1), s["n_hist"])
        s["last_compute_step"] = torch.where(compute, s["step"], s["last_compute_step"])
        return self._pack(s)


def build_sea_program(config: SeaCacheConfig, *, image_stream: int, image_residual: torch.Tensor,
                      stream_residuals: Sequence[torch.Tensor], has_timestep: bool, group=None) -> SeaProgram:
    """``image_residual``: the transformer's ``hidden_states`` input (the decide's first argument)."""
    latents = sea_latents(image_residual)
    specs = _scalar_specs({"acc": (torch.float64, 0.0), "consecutive": (torch.int64, 0), "has_ind": (torch.bool, 0),
                           "n_hist": (torch.int64, 0), "hist_step": (torch.int64, -1),
                           "hist_step_prev": (torch.int64, -1)})
    specs += [StateSpec("ind", tuple(latents.shape), latents.dtype)]
    specs += [StateSpec(f"res{i}", tuple(r.shape), r.dtype) for i, r in enumerate(stream_residuals)]
    if config.residual_order == 1:
        img = stream_residuals[image_stream]
        specs += [StateSpec("res_prev", tuple(img.shape), img.dtype)]
    return SeaProgram(config=config, state_spec=specs, num_streams=len(stream_residuals), has_timestep=has_timestep,
                      group=group, reads_fn_residual=False, num_inference_steps=config.num_inference_steps,
                      image_stream=image_stream)


@dataclasses.dataclass(eq=False, kw_only=True)
class TeaProgram(ImageResidualProgram):
    config: TeaCacheConfig

    def decide_call(self, modulated, timestep, flat):
        s = self._begin(flat, timestep)
        cfg, step, prev = self.config, s["step"], s["mod_prev"]
        num = (modulated - prev).abs().mean()
        den = prev.abs().mean()
        allreduce = self.allreduce_means()
        if allreduce is not None:
            num, den = allreduce(num, den)
        rel = (num / den).to(torch.float64)
        edge = (step == 0) | (step == cfg.num_inference_steps - 1)
        acc = s["acc"] + cfg.rescale(rel)
        use_cache = ~edge & (acc < cfg.threshold) & s["has_prev"]
        s["acc"] = torch.where(use_cache, acc, 0.0)
        s["mod_prev"] = modulated.to(prev.dtype)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=step.device)
        diff = torch.where(edge, nan, acc)  # the accumulated rescaled distance stands for the diff
        self._finish(s, use_cache, diff, ~edge)
        return (use_cache, diff, *self._image_hits(s), *self._pack(s))

    def commit_call(self, use_cache, flat):
        values, s = flat[:self.num_streams], self._unpack(flat[self.num_streams:])
        self._store_image_residual(s, ~use_cache, values)
        return self._pack(s)


def build_tea_program(config: TeaCacheConfig, *, image_stream: int, image_residual: torch.Tensor,
                      stream_residuals: Sequence[torch.Tensor], has_timestep: bool, group=None) -> TeaProgram:
    """``image_residual``: the first block's modulated input (the decide's first argument)."""
    img = stream_residuals[image_stream]
    specs = _scalar_specs({"acc": (torch.float64, 0.0)})
    specs += [StateSpec("mod_prev", tuple(image_residual.shape), image_residual.dtype),
              StateSpec("res", tuple(img.shape), img.dtype)]
    return TeaProgram(config=config, state_spec=specs, num_streams=len(stream_residuals), has_timestep=has_timestep,
                      group=group, reads_fn_residual=False, num_inference_steps=config.num_inference_steps,
                      image_stream=image_stream, passthrough=tuple((tuple(r.shape), r.dtype) for r in stream_residuals))


__all__ = ["SeaProgram", "TeaProgram", "build_sea_program", "build_tea_program", "sea_indicator", "sea_latents"]
