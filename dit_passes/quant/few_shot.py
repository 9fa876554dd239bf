"""SVDQuant dynamic quantization with few-shot smoothing (cache-dit 1.5.3's ``smooth_strategy="few_shot"``).

DQ has no calibration prompts; few-shot takes the smoothing statistics from the first real forwards instead. The
model runs unquantized for ``steps`` forwards (its outputs are the unquantized model's) while the per-input-channel
abs-max ("span") of every selected linear's input is recorded; then the smoothing vector of each linear is computed
from its span and its weight, and the quantized linears are built once and used from the next forward on.

Smoothing (``few_shot_smoothing``): a few forwards see fewer outliers than a long run would, so the span is first
*relaxed*: each channel ``i`` is multiplied by ``m_i = 1 + r_i * (relax_factor - 1)`` with a response ``r_i`` in
[0, 1] that grows with the span (larger spans are where later steps bring larger values); then
``s = span_relaxed**alpha / w_absmax**(1 - alpha)``, a zero or non-finite factor replaced by 1. The response, with
``tau`` the span's ``(1 - top_ratio)`` quantile and ``lo`` its minimum, ``u = clamp((span - lo) / (tau - lo), 0, 1)``:

* ``fixed``: 0 (no relaxation); ``top``: 1 where ``span >= tau``, else 0;
* ``auto``: ``u``; ``stable_auto``: ``u`` rounded to eighths; ``power``: ``u**2``; ``log``: ``log(1 + 9u) / log(10)``;
* ``rank``: the channel's rank over ``K - 1`` (ties in index order), divided by ``1 - top_ratio``, clamped to [0, 1].

(``auto`` and its variants give every channel 1 when ``tau <= lo``, and nothing when the span is not finite.)

The state of one model's collection is a :class:`FewShotSession` (``runtime.state``, the caller reads it back as a
report); the observation is the graph op ``dit_passes::few_shot_observe`` the quantize pass inserts in front of each
linear while the session collects (``passes/quantize_few_shot.py``).
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

logger = logging.getLogger("dit_passes")

RELAX_STRATEGIES = ("fixed", "top", "auto", "stable_auto", "power", "log", "rank")
RELAX_ALIASES = {"top_q4": "top"}
# cache-dit 1.5.3's defaults (svdq_kwargs few_shot_*)
DEFAULTS = {"steps": 1, "relax_factor": 1.5, "relax_top_ratio": 0.25, "relax_strategy": "auto"}
AGGRESSIVE_RELAX = 3.0  # above this, relaxation tends to oversmooth (cache-dit warns too)
_BUCKETS, _POWER, _LOG_STRENGTH = 8, 2.0, 9.0


def check_options(steps=DEFAULTS["steps"], relax_factor=DEFAULTS["relax_factor"],
                  relax_top_ratio=DEFAULTS["relax_top_ratio"], relax_strategy=DEFAULTS["relax_strategy"],
                  what: str = "{}", warn: bool = True) -> Dict[str, object]:
    """The few-shot options validated and normalised (``relax_strategy`` lower-cased, ``"top_q4"`` read as
    ``"top"``); ``what`` names an option in errors (the front end's ``"svdq_kwargs['few_shot_{}']"``); ``warn``: log
    an aggressive ``relax_factor``."""
    name = what.format
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name('steps')} must be a positive int (the forwards observed before quantizing), "
                         f"got {steps!r}")
    if isinstance(relax_factor, bool) or not isinstance(relax_factor, (int, float)) or not relax_factor >= 1.0 \
            or not math.isfinite(relax_factor):
        raise ValueError(f"{name('relax_factor')} must be a finite number >= 1.0 (1: no relaxation), "
                         f"got {relax_factor!r}")
    if isinstance(relax_top_ratio, bool) or not isinstance(relax_top_ratio, (int, float)) \
            or not 0.0 < relax_top_ratio <= 1.0:
        raise ValueError(f"{name('relax_top_ratio')} must lie in (0, 1] (the share of channels with the largest "
                         f"spans), got {relax_top_ratio!r}")
    strategy = relax_strategy.lower() if isinstance(relax_strategy, str) else relax_strategy
    strategy = RELAX_ALIASES.get(strategy, strategy)
    if strategy not in RELAX_STRATEGIES:
        raise ValueError(f"{name('relax_strategy')} must be one of {RELAX_STRATEGIES} (or 'top_q4' for 'top'), "
                         f"got {relax_strategy!r}")
    if warn and strategy != "fixed" and relax_factor > AGGRESSIVE_RELAX:
        logger.warning("%s=%s is aggressive: the smoothing may blur outputs; values around 1.5-2.5 are the usual "
                       "range", name("relax_factor"), relax_factor)
    return {"steps": steps, "relax_factor": float(relax_factor), "relax_top_ratio": float(relax_top_ratio),
            "relax_strategy": strategy}


def relax_response(span: torch.Tensor, top_ratio: float, strategy: str) -> torch.Tensor:
    """The per-channel response r in [0, 1] of ``strategy`` for an fp32 span [K] (module docstring)."""
    a = span.float()
    if strategy == "fixed":
        return torch.zeros_like(a)
    q = max(0.0, 1.0 - top_ratio)
    tau = torch.quantile(a, q)
    if strategy == "top":
        return (a >= tau).to(a.dtype)
    if strategy == "rank":
        if a.numel() <= 1 or q <= 0.0:
            return torch.ones_like(a)
        # rank / (K - 1): the linspace cache-dit assigns along the stable sort, written as a scatter
        pos = torch.empty_like(a)
        pos[torch.argsort(a, stable=True)] = torch.linspace(0.0, 1.0, a.numel(), dtype=a.dtype, device=a.device)
        return (pos / q).clamp(0.0, 1.0)
    lo = a.min()
    if not (torch.isfinite(lo) and torch.isfinite(tau)):
        return torch.zeros_like(a)
    if tau <= lo:  # every channel alike: no order to ramp along
        return torch.ones_like(a)
    u = ((a - lo) / (tau - lo)).clamp(0.0, 1.0)
    if strategy == "auto":
        return u
    if strategy == "stable_auto":
        return torch.floor(u * _BUCKETS + 0.5) / _BUCKETS
    if strategy == "power":
        return u.pow(_POWER)
    if strategy == "log":
        return torch.log1p(_LOG_STRENGTH * u) / math.log1p(_LOG_STRENGTH)
    raise ValueError(f"unknown relax strategy {strategy!r}; one of {RELAX_STRATEGIES}")


def _smooth(span: torch.Tensor, w_span: torch.Tensor, alpha: float) -> torch.Tensor:
    s = span.pow(alpha)
    if alpha < 1.0:
        s = s / w_span.pow(1.0 - alpha)
    # a dead channel (span or weight column all zero) gets 1: neither side has anything to move
    return torch.where((s == 0) | ~torch.isfinite(s), torch.ones_like(s), s)


def few_shot_smoothing(span: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5,
                       relax_factor: float = DEFAULTS["relax_factor"],
                       relax_top_ratio: float = DEFAULTS["relax_top_ratio"],
                       relax_strategy: str = DEFAULTS["relax_strategy"]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(s_relaxed, s_observed)`` [K] fp32: the smoothing vector from the relaxed span, and from the span as
    observed (the module docstring's formulas). ``span``: the input abs-max per channel [K]; ``weight`` [N, K]."""
    k = weight.shape[1]
    if span.dim() != 1 or span.shape[0] != k:
        raise ValueError(f"span must have shape ({k},) (one abs-max per input channel of the weight [N, K]), got "
                         f"{tuple(span.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    opts = check_options(relax_factor=relax_factor, relax_top_ratio=relax_top_ratio, relax_strategy=relax_strategy,
                         warn=False)
    a = span.detach().to(weight.device, torch.float32)
    w_span = weight.detach().float().abs().amax(dim=0)
    observed = _smooth(a, w_span, alpha)
    r = relax_response(a, opts["relax_top_ratio"], opts["relax_strategy"]).clamp(0.0, 1.0)
    if opts["relax_strategy"] == "fixed":
        return observed.clone(), observed
    relaxed = _smooth(a * (1.0 + r * (opts["relax_factor"] - 1.0)), w_span, alpha)
    return relaxed, observed


# --------------------------------------------------------------------------------------------- observation
@torch.library.custom_op("dit_passes::few_shot_observe", mutates_args=("span",))
def few_shot_observe(span: torch.Tensor, x: torch.Tensor) -> None:
    """``span = max(span, |x| per last-dim channel)`` in place (fp32 [K]); the input itself is left alone."""
    cur = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).to(span.device, span.dtype)
    torch.maximum(span, cur, out=span)


@few_shot_observe.register_fake
def _(span, x):
    return None


OBSERVE_OP = torch.ops.dit_passes.few_shot_observe.default


class FewShotSession:
    """One model's few-shot collection: the spans observed so far (``spans``: linear path -> fp32 [K], filled in
    place by the graph's observe ops), the forwards counted (``completed_forwards``, cumulative over generations,
    as cache-dit counts them: every call of the transformer, a CFG pair's two calls two), and whether the quantized
    linears are built (``collecting`` False). Kept in ``runtime.state`` and readable as the pass's report."""

    drop_on_relower = False  # set_passes keeps it: a new pass list re-lowers from the spans already collected

    def __init__(self, options: Dict[str, object]):
        self.options = dict(options)
        self.steps = int(self.options["steps"])
        self.spans: Dict[str, torch.Tensor] = {}
        self._bound: Dict[str, List[Tuple[Any, str]]] = {}
        self.completed_forwards = 0
        self.collecting = True
        self.quantized_after: Optional[int] = None  # forwards observed when quantization was asked for
        self.group: Any = None  # context parallelism: the sequence group whose ranks' spans are merged (max)

    def span(self, path: str, k: int, device: torch.device) -> torch.Tensor:
        """The span buffer of linear ``path``: -1 until observed (|x| >= 0, so the first call's max replaces it and a
        linear that never ran stays recognisable)."""
        t = self.spans.get(path)
        if t is None:
            t = self.spans[path] = torch.full((k,), -1.0, dtype=torch.float32, device=device)
        elif t.shape[0] != k:
            raise ValueError(f"few-shot span of {path}: {t.shape[0]} channels recorded, the graph's linear has {k}")
        elif t.device != device:  # the model moved between forwards: follow it, keeping what was seen
            t = self.spans[path] = t.to(device)
        return t

    def bind(self, path: str, gm: torch.nn.Module, attr: str) -> None:
        """Graph ``gm`` holds ``path``'s span as buffer ``attr``: a move of the module (``.to()``) gives the graph
        its own copy, which :meth:`observed` then reads too (the graph only weakly: a dropped graph is skipped)."""
        self._bound.setdefault(path, []).append((weakref.ref(gm), attr))

    def _merged(self, path: str) -> torch.Tensor:
        span = self.spans[path]
        for ref, attr in self._bound.get(path, ()):
            t = getattr(ref(), attr, None) if ref() is not None else None
            if t is not None and t is not span:
                span = torch.maximum(span, t.to(span.device))
        return span

    def observed(self) -> Dict[str, torch.Tensor]:
        """The spans of the linears that ran, the max over every graph's copy (one that never ran still holds -1:
        left out)."""
        out = {}
        for path in self.spans:
            span = self._merged(path)
            if bool(span[0] >= 0):
                out[path] = span
        return out

    def _reduce(self) -> None:
        """The element-wise max of every rank's spans over ``group`` (the ranks sharing the sequence: each saw its
        own tokens), one all-reduce, so every rank quantizes from the whole sequence's spans, the same numbers."""
        import torch.distributed as dist
        paths = sorted(self.spans)
        if not paths:
            return
        merged = [self._merged(p) for p in paths]
        flat = torch.cat([m.reshape(-1) for m in merged])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        at = 0
        for p, m in zip(paths, merged):
            self.spans[p] = flat[at:at + m.numel()].to(m.device)
            at += m.numel()
        self._bound.clear()  # the graphs' copies are each <= the reduced span

    def after_call(self) -> bool:
        """Count a forward; True (re-lower the graphs) when it was the last one to observe."""
        if not self.collecting:
            return False
        self.completed_forwards += 1
        if self.completed_forwards < self.steps:
            return False
        self.collecting = False
        self.quantized_after = self.completed_forwards
        if self.group is not None:
            self._reduce()
        logger.info("SVDQuant few-shot: %d forward(s) observed, %d linear(s) with spans; quantizing at the next "
                    "call", self.completed_forwards, len(self.observed()))
        return True

    def summary(self) -> Dict[str, object]:
        return {"collecting": self.collecting, "completed_forwards": self.completed_forwards, "steps": self.steps,
                "observed_linears": len(self.observed()), "options": dict(self.options)}

    def __repr__(self) -> str:
        return f"FewShotSession({self.summary()})"


__all__ = ["RELAX_STRATEGIES", "DEFAULTS", "check_options", "relax_response", "few_shot_smoothing",
           "few_shot_observe", "OBSERVE_OP", "FewShotSession"]
