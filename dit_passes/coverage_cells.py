"""The cells of ``dit-passes coverage`` (:mod:`dit_passes.coverage`): what each column checks and how one cell runs,
in this process or on gloo ranks. Each cell is

* ``exact``: the column's passes changed the graph and the rewritten module matches (fp32 max relative error <=
  :data:`TOLERANCE`; the cache columns: a :data:`LOOP_STEPS`-step loop whose latents move with the output caches
  some steps, its computed steps equal eager on their inputs, and where cache-dit 1.5.3 runs the class every step
  equals cache-dit's own cache, the cached ones included; SVDQuant's reference path: finite and within
  :data:`SVDQUANT_BOUND`, the error of 4-bit weights and activations; fp8's reference path: within
  :data:`FP8_RATIO` x the model's error with the same linears' weights alone in e4m3);
* ``nothing to do: <reason>``: the passes changed nothing (their own report says why: no pattern of theirs in the
  graph) and the output still matches; a quantization column that quantized no linear, or a cache that moved no
  block into its branch, is an error instead;
* ``refused: <reason>``: the library refused before running (a ``PassError``, a capture or block-discovery
  error, a sharding / mesh error: what a user reads; not ``PassCrashed``, a pass's own crash while rewriting);
* ``error: <type: msg>``: anything else (a crash while running, a wrong result, a timeout): a defect.

The columns: ``capture`` (no pass), ``dbcache`` / ``taylorseer`` (the cache), ``regional`` (RegionalCompile,
aot_eager), ``svdquant`` (SVDQuantW4A4's reference path), ``epilogues`` (the EPILOGUES phase: SplitConcatLinear
and FuseLinearGelu; the detail says how many linears each rewrote, ``split`` / ``gelu``), ``fuse``
(FuseSiblingLinears: ``groups`` fused), ``fp8`` (Fp8Linear's defaults: every block linear but a mixture of
experts' router; ``linears`` quantized), ``attention`` (AttentionBackend("cudnn"), the CPU's kernel as fallback:
``attention`` pinned), ``norm_rope`` (FuseNormRope, the op's reference on the CPU: ``ropes`` fused),
``norm_modulate`` (FuseNormModulate, likewise: ``norms`` fused), and on gloo ranks ``ulysses``, ``ring``, ``usp``,
``tp``.

Every cell keeps, beside its status, ``error`` (the max relative error measured) and ``changed``: the column's
passes' own counts from their records of the lowered graph (``replaced`` / ``considered`` / ``skipped_<reason>``
linears, ``fused`` sites, ``blocks_in_branch``, ``all_to_all`` ...); the cache columns also ``cached_steps``. The
quantization columns build each family wider (``zoo.group_widths``: more heads of the same width) so every block
linear's K is a multiple of the kind's group (64 for int4): at the zoo's width of 32 an int4 kind quantizes none.

The models are the zoo's tiny configs with every all-zero floating parameter redrawn (seeded, the same on
every rank: ``zoo.build(..., redraw_zeros=True)``): diffusers zero-initialises gates, modulation and output
projections and norm biases, and behind a zero gate a check against eager cannot see a wrong rewrite.

The local columns run in this process, one model build per cell; the parallel ones run in one
``run_ranks`` call on 2 gloo ranks for every family, each cell on its own process group with the cell's
timeout, so a hang in one cell cannot stall the rest.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import signal
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils._pytree as pytree

__all__ = ["COLUMNS", "LOCAL_COLUMNS", "PARALLEL_COLUMNS", "TOLERANCE", "SVDQUANT_BOUND", "FP8_RATIO", "FP8_BOUND",
           "WORLD", "EXACT", "NOTHING", "REFUSED", "ERROR", "NO_CONFIG", "STATUSES", "QUANT_COLUMNS",
           "CACHE_COLUMNS", "Cell", "CellTimeout", "Outcome", "run_cell", "run_local",
           "run_parallel", "parallel_worker"]

LOCAL_COLUMNS = ("capture", "dbcache", "taylorseer", "regional", "svdquant", "epilogues", "fuse", "fp8", "attention",
                 "norm_rope", "norm_modulate")
PARALLEL_COLUMNS = ("ulysses", "ring", "usp", "tp")
COLUMNS = LOCAL_COLUMNS + PARALLEL_COLUMNS
TOLERANCE = 1e-5
SVDQUANT_BOUND = 0.25
# fp8 (e4m3 weights per channel and activations per token) has no bound that holds for every class and still
# catches a wrong rewrite: over all 130 rows its error vs eager runs from 1.3e-3 (AuraFlow) to 0.087 (HunyuanDiT),
# while the rewrite with its square weights transposed or its bias dropped errs by only 0.041 - 0.092 on CogView3+,
# FLUX, SD3, QwenImage, HunyuanVideo. Each model's own sensitivity to e4m3 sets the bound instead: the same linears
# with e4m3 weights only (``Fp8Linear(weight_only=True)``, activations in fp32; another graph form) err by e_w,
# and the fp8 cell must stay within FP8_RATIO * e_w. Measured on 14 classes: fp8 / e_w = 1.2 - 2.1 (activations
# rounded too), a transposed weight 11 - 35 e_w, a dropped bias 5.4 - 42 e_w (where the model has square weights /
# biases; AuraFlow's or Cosmos's rewrite so broken is the correct one); 3.5 sits between. e_w itself must stay
# within FP8_BOUND (0.041 at most on those 14), so a defect shared by both forms cannot widen the bound unseen.
FP8_RATIO = 3.5
FP8_BOUND = 0.1
WORLD = 2

EXACT, NOTHING, REFUSED, ERROR, NO_CONFIG = "exact", "nothing to do", "refused", "error", "no config"
STATUSES = (EXACT, NOTHING, REFUSED, ERROR, NO_CONFIG)
# columns whose pass must change something on every family: a quantization that quantized no linear is an error
QUANT_COLUMNS = ("svdquant", "fp8")
CACHE_COLUMNS = ("dbcache", "taylorseer")


@dataclasses.dataclass
class Cell:
    status: str                 # exact / nothing to do / refused / error / no config
    detail: str = ""            # the reason (nothing to do / refused / error), or the measured error (exact)
    seconds: float = 0.0
    error: Optional[float] = None   # max relative error vs the column's reference, where it was measured
    # what the column's passes did, their own counts summed (linears replaced / skipped_<reason>, sites fused,
    # blocks_in_branch, all_to_all ...); empty where nothing was lowered
    changed: Dict[str, int] = dataclasses.field(default_factory=dict)
    cached_steps: Optional[int] = None  # the cache columns: calls served from the cache

    def text(self) -> str:
        return self.status if not self.detail or self.status == EXACT else f"{self.status}: {self.detail}"


@dataclasses.dataclass
class Outcome:
    """What a column's check returns: the text of an exact cell, the numbers beside it, and ``nothing``, the pass's
    own reason where it changed nothing (the cell is then ``nothing to do``, not ``exact``)."""
    detail: str
    error: Optional[float] = None
    changed: Dict[str, int] = dataclasses.field(default_factory=dict)
    nothing: Optional[str] = None
    cached_steps: Optional[int] = None


class CellTimeout(BaseException):
    """The cell ran past its time budget. A BaseException, as KeyboardInterrupt is: the alarm can fire inside code
    that retries on ``Exception`` (capture tries export again, or with an opaque module, after a failed attempt),
    which would swallow the deadline and let the cell run on."""


class _Refused(Exception):
    """Carries a refusal raised while lowering (capture + passes), before anything ran."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise CellTimeout in this (main) thread after ``seconds``; a no-op off the main thread."""
    import threading
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"cell ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _refusal_types() -> tuple:
    from .analysis.blocks import NoRepeatedBlocksError
    from .capture import CaptureError
    from .infra.pass_base import PassError
    from .parallel.mesh import MeshError
    from .parallel.tp_sharding import ShardingError
    return (PassError, CaptureError, NoRepeatedBlocksError, ShardingError, MeshError)


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _leaves(out) -> List[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _max_rel(actual, expected) -> float:
    """Max over the output tensors of max |a - e| / max |e| (inf when the structure or shapes differ)."""
    a, e = _leaves(actual), _leaves(expected)
    if len(a) != len(e) or any(x.shape != y.shape for x, y in zip(a, e)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, e):
        if not torch.isfinite(x).all():
            return float("inf")
        scale = y.float().abs().max().clamp_min(1e-30)
        worst = max(worst, ((x.float() - y.float()).abs().max() / scale).item())
    return worst


def _compile(model, passes, inputs):
    """compile_dit + lower now: a refusal here is raised as _Refused, anything else propagates."""
    from . import compile_dit
    from .infra.pass_base import PassCrashed
    try:
        compiled = compile_dit(model, passes=passes())
        compiled.lower(**inputs)
        return compiled
    except PassCrashed:  # a crash inside a pass's rewrite (wrapped as a PassError): a defect, not a refusal
        raise
    except _refusal_types() as e:
        if _timed_out(e):  # a refusal type wrapping the cell's deadline: the time ran out, nothing was refused
            raise
        raise _Refused(_short(e)) from e


def _timed_out(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CellTimeout):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _within(rel: float, bound: float, what: str) -> None:
    if not rel <= bound:
        raise AssertionError(f"{what}: max relative error {rel:.3g} > {bound:g}")


# --------------------------------------------------------------------------------------- the columns
def _what_changed(compiled, passes: Callable[[], list]) -> Tuple[Dict[str, int], Optional[str]]:
    """The column's passes' own counts, summed over their records of the lowered graph (the passes ``passes()``
    names; not the Cleanup every compile runs), and None where one of them changed the graph, else their reports
    (why each did nothing); no pass at all changed nothing and is no "nothing to do"."""
    names = {p.name for p in passes()}
    if not names:  # the capture column: no pass, the captured graph is what it checks
        return {}, None
    records = [r for r in compiled._current().manager.records if r.name in names]
    changed: Dict[str, int] = {}
    for r in records:
        for key, value in r.result.counts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                changed[key] = changed.get(key, 0) + value
    if any(r.result.changed for r in records):
        return changed, None
    why = "; ".join(" ".join(str(r.result.report).split()) for r in records if r.result.report)
    return changed, why or f"no record of {sorted(names)} in the lowered graph"


def _check_plain(passes: Callable[[], list], bound: Union[float, Callable] = TOLERANCE,
                 describe: Optional[Callable] = None, must_change: bool = False):
    """The output vs eager within ``bound`` (a number, or ``bound(zm, inputs, reference) -> (bound, note)`` run
    before the passes touch the model); ``describe(compiled)`` adds to the detail (what the passes did). A pass
    that changed nothing makes the cell ``nothing to do`` (its reason), or an error where ``must_change``."""
    def check(zm, inputs, reference) -> Outcome:
        limit, note = bound(zm, inputs, reference) if callable(bound) else (bound, "")
        compiled = _compile(zm.model, passes, inputs)
        with torch.no_grad():
            out = compiled(**inputs)
        rel = _max_rel(out, reference)
        changed, nothing = _what_changed(compiled, passes)
        if nothing is not None and must_change:
            raise AssertionError(f"the pass changed nothing: {nothing}")
        _within(rel, limit, "output vs eager")
        detail = f"rel {rel:.1e}" + (f" ({note})" if note else "") + (f", {describe(compiled)}" if describe else "")
        return Outcome(detail, rel, changed, nothing)
    return check


def _check_quant(make: Callable[[], object], bound: Union[float, Callable], describe: Optional[Callable] = None):
    """:func:`_check_plain` for a quantize pass: run at the widths its kinds' groups fit (``check.k_multiple``,
    the group K must be a multiple of: :func:`run_cell` builds the family at those widths), an error where it
    quantized no linear."""
    check = _check_plain(lambda: [make()], bound, describe, must_change=True)
    p = make()
    kinds = {p.kind, getattr(p, "modulation", None)} - {None}  # SVDQuant's modulation linears: their own kind
    check.k_multiple = max(p.k_multiple(k) for k in kinds)
    return check


def _fp8_bound(zm, inputs, reference):
    """FP8_RATIO x the error of e4m3 weights alone on a second build of the model (see FP8_RATIO), checked to be the
    same model by one eager run (the capture needs none before it: see ``dit_passes.capture_caches``)."""
    from .models.zoo import build
    from .passes import Fp8Linear
    twin = build(zm.family, redraw_zeros=True, **zm.overrides).model
    with torch.no_grad():
        _within(_max_rel(twin(**inputs), reference), 0.0, "a second build of the model (the fp8 bound's) vs the first")
    compiled = _compile(twin, lambda: [Fp8Linear(weight_only=True)], inputs)
    with torch.no_grad():
        e_w = _max_rel(compiled(**inputs), reference)
    _within(e_w, FP8_BOUND, "e4m3 weights only (the fp8 bound's reference) vs eager")
    return FP8_RATIO * e_w, f"weights only {e_w:.1e}"


def _pass_counts(shown: Dict[str, tuple]) -> Callable:
    """A ``describe`` for :func:`_check_plain`: ``{pass name: (count key, label)}`` -> "label n, ..." from the
    lowered graph's pass records (0 for a pass not among them)."""
    def describe(compiled) -> str:
        records = compiled._current().manager.records
        return ", ".join(f"{label} {sum(r.result.counts.get(key, 0) for r in records if r.name == name)}"
                         for name, (key, label) in shown.items())
    return describe


LOOP_STEPS = 10  # the cache columns' denoising loop
LOOP_STEP_SIZE = 0.05  # latents <- latents - LOOP_STEP_SIZE * output after each step


def _moving_key(inputs: dict, out) -> Optional[str]:
    """The input the loop moves with the output: ``hidden_states`` where it has the output's size, else the first
    tensor input that has (None: no input has, the loop's inputs stay fixed but for the timestep)."""
    first = _leaves(out)[0]
    keys = ["hidden_states"] + [k for k in inputs if k != "hidden_states"]
    return next((k for k in keys if isinstance(inputs.get(k), torch.Tensor) and inputs[k].is_floating_point()
                 and inputs[k].numel() == first.numel()), None)


def _denoise(model, inputs: dict, key: Optional[str], steps: int = LOOP_STEPS):
    """A short Euler-like loop: the timestep falls to half its value, the input ``key`` moves with the output.
    Returns the outputs and each step's inputs."""
    outs, seen, kw = [], [], dict(inputs)
    t0 = inputs.get("timestep")
    for i in range(steps):
        if isinstance(t0, torch.Tensor):
            kw["timestep"] = (t0.double() * (1 - 0.5 * i / steps)).to(t0.dtype)
        seen.append(dict(kw))
        with torch.no_grad():
            out = model(**kw)
        outs.append(out)
        if key is not None:
            kw[key] = kw[key] - LOOP_STEP_SIZE * _leaves(out)[0].reshape(kw[key].shape).to(kw[key].dtype)
    return outs, seen


def _cache_dit_run(model, inputs: dict, key: Optional[str], config: dict, calibrator: Optional[dict]):
    """cache-dit 1.5.3's own DBCache on a copy of ``model`` over the same loop: (outputs, cached step indices), or
    (None, why) where cache-dit is not installed or does not take this class."""
    import copy
    import logging
    try:
        import cache_dit
    except ImportError:
        return None, "cache-dit not installed"
    logging.getLogger("cache_dit").setLevel(logging.ERROR)  # after the import, which sets its own level
    ref = copy.deepcopy(model)
    extra = {} if calibrator is None else dict(calibrator_config=cache_dit.TaylorSeerCalibratorConfig(**calibrator))
    try:
        cache_dit.enable_cache(ref, cache_config=cache_dit.DBCacheConfig(num_inference_steps=LOOP_STEPS, **config),
                               **extra)
        outs, _ = _denoise(ref, inputs, key)
        return outs, list(cache_dit.summary(ref)[0].cached_steps)
    except Exception as e:  # noqa: BLE001 - a class cache-dit's adapters do not take: no reference, said so
        return None, f"cache-dit does not run it ({_short(e, 120)})"


def _check_cache(config: dict, calibrator: Optional[dict] = None):
    """DBCache with ``config`` (and TaylorSeer's ``calibrator``) over a :data:`LOOP_STEPS`-step loop whose inputs
    move with the output: some steps must be cached; every computed step equals eager on that step's inputs; and
    where cache-dit 1.5.3 runs the class, the loop equals cache-dit's own (the same cached steps, every output
    within :data:`TOLERANCE`), cached steps included."""
    from .cache.config import TaylorSeerCalibratorConfig
    from .passes import DBCache

    def passes():
        cal = None if calibrator is None else TaylorSeerCalibratorConfig(**calibrator)
        return [DBCache(calibrator=cal, **config)]

    def check(zm, inputs, reference) -> Outcome:
        import copy
        eager = copy.deepcopy(zm.model)  # before the passes touch the model
        compiled = _compile(zm.model, passes, inputs)
        key = _moving_key(inputs, reference)
        outs, seen = _denoise(compiled, inputs, key)
        changed, nothing = _what_changed(compiled, passes)
        if nothing is not None:
            raise AssertionError(f"the cache moved no block into its branch: {nothing}")
        cached = [bool(c) for c in compiled.report("dbcache").last_generation()["step_cached"]]
        if len(cached) != LOOP_STEPS or not any(cached):
            raise AssertionError(f"cache decisions {cached} over {LOOP_STEPS} steps: no step cached")
        worst = 0.0
        for i, c in enumerate(cached):
            if not c:
                with torch.no_grad():
                    rel = _max_rel(outs[i], eager(**seen[i]))
                _within(rel, TOLERANCE, f"computed step {i} vs eager on its inputs")
                worst = max(worst, rel)
        ref_outs, ref_cached = _cache_dit_run(eager, inputs, key, config, calibrator)
        if ref_outs is not None:  # cache-dit is a reference only where its computed steps are the model's
            first = min(ref_cached) if ref_cached else LOOP_STEPS
            with torch.no_grad():
                off = max(_max_rel(ref_outs[i], eager(**seen[i])) for i in range(first))
            if not off <= TOLERANCE:
                ref_outs, ref_cached = None, f"cache-dit's own computed steps differ from eager by {off:.2g}"
        if ref_outs is None:
            note = f"no reference for the cached steps: {ref_cached}"
        else:
            ours = [i for i, c in enumerate(cached) if c]
            if ours != ref_cached:
                raise AssertionError(f"cached steps {ours}, cache-dit's {ref_cached}")
            for i in range(LOOP_STEPS):
                rel = _max_rel(outs[i], ref_outs[i])
                _within(rel, TOLERANCE, f"step {i} vs cache-dit")
                worst = max(worst, rel)
            note = "vs cache-dit"
        moved = f"{key} moving" if key else "inputs fixed but the timestep"
        return Outcome(f"rel {worst:.1e}, {sum(cached)} of {LOOP_STEPS} steps cached ({moved}; {note})", worst,
                       changed, cached_steps=sum(cached))
    return check


def _local_checks() -> Dict[str, Callable]:
    from .passes import (AttentionBackend, Fp8Linear, FuseLinearGelu, FuseNormModulate, FuseNormRope,
                         FuseSiblingLinears, RegionalCompile, SplitConcatLinear, SVDQuantW4A4)

    # a schedule that caches several steps of the loop: after 2 computed ones, up to 2 cached in a row while the
    # first block's residual changes by less than its own size
    loop = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=2,
                max_continuous_cached_steps=2, enable_separate_cfg=False)
    return {
        "capture": _check_plain(lambda: []),
        "dbcache": _check_cache(loop),
        "taylorseer": _check_cache(loop, dict(taylorseer_order=1)),
        "regional": _check_plain(lambda: [RegionalCompile(backend="aot_eager")]),
        "svdquant": _check_quant(lambda: SVDQuantW4A4(rank=4, dynamic=True), SVDQUANT_BOUND, describe=_pass_counts(
            {SVDQuantW4A4.name: ("replaced", "linears")})),
        # the EPILOGUES phase; the detail counts the linears each rewrote (0: nothing of the pattern there)
        "epilogues": _check_plain(lambda: [SplitConcatLinear(), FuseLinearGelu()], describe=_pass_counts(
            {SplitConcatLinear.name: ("split", "split"), FuseLinearGelu.name: ("fused", "gelu")})),
        # the siblings' outputs are slices of one wider matmul: exact up to the summation order
        "fuse": _check_plain(lambda: [FuseSiblingLinears()], describe=_pass_counts(
            {FuseSiblingLinears.name: ("fused_groups", "groups")})),
        "fp8": _check_quant(lambda: Fp8Linear(), _fp8_bound, describe=_pass_counts(
            {Fp8Linear.name: ("replaced", "linears")})),
        # on the CPU the pinned kernel falls back to the math one, which eager runs too
        "attention": _check_plain(lambda: [AttentionBackend("cudnn")], describe=_pass_counts(
            {AttentionBackend.name: ("attention_rewritten", "attention")})),
        # q / k RMSNorm + interleaved rope as one op; on the CPU the op is the ATen ops it replaces
        "norm_rope": _check_plain(lambda: [FuseNormRope()], describe=_pass_counts(
            {FuseNormRope.name: ("fused", "ropes")})),
        # AdaLN's LayerNorm + modulation (+ the gated residual) as one op; on the CPU the ATen ops it replaces
        "norm_modulate": _check_plain(lambda: [FuseNormModulate()], describe=_pass_counts(
            {FuseNormModulate.name: ("fused", "norms")})),
    }


def _parallel_checks(group) -> Dict[str, Callable]:
    from .passes import USP, Ring, TensorParallel, Ulysses
    size = torch.distributed.get_world_size(group)
    return {
        "ulysses": _check_plain(lambda: [Ulysses(size=size, group=group)]),
        "ring": _check_plain(lambda: [Ring(size=size, group=group)]),
        "usp": _check_plain(lambda: [USP(ulysses=size, ring=1, group=group)]),
        "tp": _check_plain(lambda: [TensorParallel(size=size, group=group)]),
    }


def run_cell(family: str, check: Callable, timeout: float, batch: int = 1,
             overrides: Optional[Dict[str, object]] = None, inputs: str = "default") -> Cell:
    """Build ``family`` fresh (a pass may keep state on the module; zero parameters redrawn, see the module
    docstring; ``overrides``: config fields replaced; a quantization column's check names the multiple its groups
    need, ``check.k_multiple``, and the family is built that wide: ``zoo.group_widths``), run eager, then ``check``
    (an :class:`Outcome`, or the detail text of an exact cell); ``inputs``: the zoo's input set
    (``"alt_resolution"``: the family's second size)."""
    from .models.zoo import build, group_widths
    start = time.perf_counter()
    try:
        with _deadline(timeout):
            overrides = dict(overrides or {})
            multiple = getattr(check, "k_multiple", 1)
            if multiple > 1:
                overrides.update(group_widths(family, multiple, overrides))
            zm = build(family, redraw_zeros=True, **overrides)
            call = zm.make_inputs(batch=batch, variant=inputs, seed=1)
            with torch.no_grad():
                reference = zm.model(**call)
            out = check(zm, call, reference)
        if not isinstance(out, Outcome):
            out = Outcome(out or "")
        seconds = time.perf_counter() - start
        if out.nothing is not None:
            return Cell(NOTHING, out.nothing, seconds, out.error, out.changed, out.cached_steps)
        return Cell(EXACT, out.detail, seconds, out.error, out.changed, out.cached_steps)
    except _Refused as e:
        return Cell(REFUSED, str(e), time.perf_counter() - start)
    except CellTimeout as e:
        return Cell(ERROR, _short(e), time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - every other failure is a defect the matrix shows
        return Cell(ERROR, _short(e), time.perf_counter() - start)


@contextlib.contextmanager
def _quiet():
    """Silence the libraries' warnings while the matrix runs (they would drown the table); restored after, as
    a pooled rank (``run_ranks``) runs the next caller's function in the same process."""
    import logging
    import warnings
    loggers = [logging.getLogger(name) for name in
               ("diffusers", "torch", "torch._dynamo", "torch._inductor", "torch.fx", "torch.export")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


# Rows drawn outside the zoo's configs (``coverage_fuzz``): a row key -> (family, config overrides); a key not in
# the mapping is a family built from its zoo config.
Drawn = Optional[Dict[str, Tuple[str, Dict[str, object]]]]


def _row(key: str, drawn: Drawn) -> Tuple[str, Dict[str, object]]:
    return (drawn or {}).get(key, (key, {}))


def run_local(families: Sequence[str], columns: Sequence[str], timeout: float, batch: int = 1,
              progress: Optional[Callable[[str], None]] = None, drawn: Drawn = None,
              inputs: str = "default") -> Dict[str, Dict[str, Cell]]:
    checks = _local_checks()
    out: Dict[str, Dict[str, Cell]] = {}
    for key in families:
        family, overrides = _row(key, drawn)
        out[key] = {}
        for column in columns:
            out[key][column] = cell = run_cell(family, checks[column], timeout, batch, overrides, inputs)
            if progress:
                progress(f"{key:>16} {column:<11} {cell.seconds:6.1f} s  {cell.text()[:150]}")
    return out


def parallel_worker(rank: int, world: int, families: Sequence[str], columns: Sequence[str], timeout: float,
                    batch: int, drawn: Drawn = None, inputs: str = "default") -> Dict[str, Dict[str, dict]]:
    """One rank of the parallel columns (run by ``run_ranks``): every cell on a fresh group with the cell's
    timeout, the ranks re-synchronised on the world group between cells."""
    import torch.distributed as dist
    out: Dict[str, Dict[str, dict]] = {}
    with _quiet():
        for key in families:
            family, overrides = _row(key, drawn)
            out[key] = {}
            for column in columns:
                dist.barrier()
                group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout))
                cell = run_cell(family, _parallel_checks(group)[column], timeout, batch, overrides, inputs)
                out[key][column] = dataclasses.asdict(cell)
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
    return out


def _merge_ranks(per_rank: List[Dict[str, Dict[str, dict]]]) -> Dict[str, Dict[str, Cell]]:
    """One cell from the ranks' cells: an error on any rank wins, then a refusal, then nothing to do on any rank,
    else exact (rank 0's detail and counts, the worst error)."""
    out: Dict[str, Dict[str, Cell]] = {}
    for family, row in per_rank[0].items():
        out[family] = {}
        for column in row:
            cells = [Cell(**r[family][column]) for r in per_rank]
            for status in (ERROR, REFUSED, NOTHING):
                bad = [(i, c) for i, c in enumerate(cells) if c.status == status]
                if bad:
                    rank, c = bad[0]
                    out[family][column] = dataclasses.replace(c, detail=f"rank {rank}: {c.detail}",
                                                              seconds=max(x.seconds for x in cells))
                    break
            else:
                errors = [x.error for x in cells if x.error is not None]
                out[family][column] = dataclasses.replace(cells[0], seconds=max(x.seconds for x in cells),
                                                          error=max(errors) if errors else None)
    return out


def run_parallel(families: Sequence[str], columns: Sequence[str], timeout: float,
                 batch: int = 1, drawn: Drawn = None, inputs: str = "default") -> Dict[str, Dict[str, Cell]]:
    from .testing import run_ranks
    budget = 120.0 + timeout * len(families) * len(columns)
    per_rank = run_ranks(parallel_worker, WORLD, list(families), list(columns), timeout, batch, drawn, inputs,
                         timeout=budget)
    return _merge_ranks(per_rank)
