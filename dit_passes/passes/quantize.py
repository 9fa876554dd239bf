"""Quantization passes: the linears of the repeated blocks become W4A4 (SVDQuant) or int8 custom ops, or fp8 ATen ops.

Phase ``QUANTIZE`` (after the sharding phases, before offload and the cache). Reads ``structure`` (block
discovery) from a graph of ``compile_dit`` (weights are attributes; the Dynamo front end passes them as
inputs and is refused). Invalidates ``structure`` (the linear nodes it lists are gone).

Before (one eligible linear)::

    w = self.transformer_blocks.0.attn.to_q.weight
    b = self.transformer_blocks.0.attn.to_q.bias
    q = torch.ops.aten.linear.default(norm_x, w, b)

After (SVDQuantW4A4; Int8Linear calls ``dit_passes.int8_linear`` on ``qweight, wscale, bias``; Fp8Linear writes
plain ATen ops instead of an op -- the per-token e4m3 quantization of x, then ``aten._scaled_mm(qx, qweight.T,
sx, wscale, bias)`` on an sm_89+ GPU or the dequantized fp32 matmul elsewhere (``quant/graph_forms.py``,
``patterns/quant_linear.py``) -- so that torch.compile fuses the quantization into x's producer)::

    qw = self.transformer_blocks.0.attn.to_q.qweight        # uint8 [N, K/2], two int4 per byte
    ws = self.transformer_blocks.0.attn.to_q.wscale         # bf16 [N, K/64]
    ld = self.transformer_blocks.0.attn.to_q.lora_down      # [rank, K]
    lu = self.transformer_blocks.0.attn.to_q.lora_up        # [N, rank]
    si = self.transformer_blocks.0.attn.to_q.smooth_inv     # fp32 [K]
    b  = self.transformer_blocks.0.attn.to_q.bias
    q = torch.ops.dit_passes.svdq_w4a4_linear.default(norm_x, qw, ws, ld, lu, si, b)

Which linears: those of ``structure.linears`` inside a block (prologue/epilogue embedders and the final
projection stay), minus ``exclude`` (default: the AdaLN ``modulation`` role), restricted to ``include``
when given, then ``filter_fn(module_path, role)``. An include/exclude entry that is a role name
(``q``, ``mlp_up``, ...) matches that role; any other string matches module paths containing it.
W4A4 needs K % 64 == 0: other linears are skipped with a note, or refused when ``include`` named them.

Calibration (PTQ, ``calibrate_fn``): the pass runs ``calibrate_fn()`` once under a
``TorchFunctionMode`` that records the per-channel abs-max of the input of every ``F.linear`` call
whose weight *is* (tensor identity) the weight of an eligible linear. Why not graph observers or
module hooks: ``calibrate_fn`` runs the user's pipeline, which calls the original transformer, not
this graph, and the pass sees the graph, not the user's module; the graph's weight attributes are the
very tensor objects of the original ``nn.Linear`` modules, so identity finds them wherever they are
called, with nothing installed on any module or class. The mode is active only inside the call.
``calibrate_fn`` must not run the CompiledDiT being lowered (that would lower it again, recursively):
give the pipeline the original transformer while calibrating, or lower first with ``example_inputs``.
Lowering happens at the module's first call, often inside a pipeline run: a ``calibrate_fn`` that runs
a pipeline sharing that run's scheduler resets the scheduler mid-run; give it its own (a deep copy).

Prepared weights are kept in ``compiled.runtime.state[<pass name>]`` so that a new input signature
(another resolution, a CFG batch, the model moved to another device or dtype) reuses them: no second
calibration, identical numbers. Memory: the replaced weights leave the graph and are recorded in
``runtime.weights``; the CompiledDiT then points the user's module at meta tensors in their place (the
biases at the op's bias buffers), unless ``keep_original=True`` (DESIGN.md §14).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..analysis.blocks import get_structure
from ..infra.ownership import SAMPLE, WeightLedger, refusal, weight_sample
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..infra.weight_source import check_shape, source_name
from ..quant.calibrate import ActAbsMaxObserver
from ..quant.fp8_int8 import FP8_GRANULARITIES, prepare_fp8, prepare_int8
from ..quant.int4 import GROUP_SIZE
from ..quant.serialize import save_quantized
from ..quant.signature import FORMAT, graph_block_lists, place_tables, quant_signature, tensor_at
from ..quant.svdquant import SMOOTH_MODES, prepare_svdquant

from ..patterns.quant_linear import QUANT_KINDS, replace_linears

ROLE_NAMES = ("q", "k", "v", "qkv", "attn_out", "mlp_up", "mlp_down", "proj", "modulation", "other")
DEFAULT_EXCLUDE = ("modulation",)


# ------------------------------------------------------------------------------------- selection
def _matches(entry: str, path: str, role: str) -> bool:
    return role == entry if entry in ROLE_NAMES else entry in path


def _check_patterns(name: str, value: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{name} must be a list of non-empty strings (roles or module-path substrings), got {value!r}")
    return tuple(value)


def select_linears(structure, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None) -> List[Any]:
    """The LinearSites of the blocks that ``include`` / ``exclude`` / ``filter_fn`` accept, graph order."""
    out = []
    for site in structure.linears:
        if site.block is None:
            continue
        path, role = site.module_path, site.role
        if include is not None and not any(_matches(e, path, role) for e in include):
            continue
        if any(_matches(e, path, role) for e in exclude):
            continue
        if filter_fn is not None and not filter_fn(path, role):
            continue
        out.append(site)
    return out


# ---------------------------------------------------------------------------------- calibration
class _LinearInputObserver(TorchFunctionMode):
    """Records the input abs-max of ``F.linear`` calls whose weight is one of ``weights`` (by identity)."""

    def __init__(self, weights: Dict[str, torch.Tensor]):
        super().__init__()
        self._weights = weights  # held, so the ids below stay valid
        self._by_id = {id(w): p for p, w in weights.items()}
        self.observers = {p: ActAbsMaxObserver() for p in weights}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            path = self._by_id.get(id(w))
            if path is not None and self._weights[path] is w:
                self.observers[path](x)
        return func(*args, **kwargs)


def calibrate_linears(weights: Dict[str, torch.Tensor], calibrate_fn: Callable[[], Any]) -> Dict[str, torch.Tensor]:
    """Run ``calibrate_fn()`` and return ``{path: act_absmax [K]}`` for the linears it called."""
    mode = _LinearInputObserver(weights)
    with torch.no_grad(), mode:
        calibrate_fn()
    return {p: o.absmax for p, o in mode.observers.items() if o.absmax is not None}


# --------------------------------------------------------------------------------- substitution
def apply_quantized(gm: fx.GraphModule, sites: Sequence[Any], tables: Dict[str, Dict[str, torch.Tensor]],
                    kind: str, ledger: WeightLedger, owner: Pass) -> Dict[str, int]:
    """Replace every site whose module path has a table by the ``kind`` op (the fx patterns of
    ``dit_passes.patterns.quant_linear``); drop the replaced weights from ``gm``, recorded in ``ledger`` as
    replaced by ``owner`` (the compiled module then releases them in the user's model). Returns counts per
    role and bytes before / after."""
    counts: Dict[str, int] = {}
    bytes_before = bytes_after = 0
    seen = set()
    targets = {}
    how = f"quantized ({kind})"
    for site in sites:
        table = tables.get(site.module_path)
        if table is None:
            continue
        if site.module_path not in seen:
            seen.add(site.module_path)
            for attr in (site.weight, site.bias):
                t = tensor_at(gm, attr) if attr else None
                bytes_before += 0 if t is None else t.numel() * t.element_size()
            bytes_after += sum(t.numel() * t.element_size() for t in table.values())
            if site.bias and "bias" in table:
                # The op's bias buffer takes the original's name (<path>.bias): the same values, so any
                # other reader of that attribute is unaffected; the parameter itself leaves the graph.
                ledger.drop(gm, site.bias, by=owner, how=how, replacement=table["bias"])
        targets[site.node] = (site.module_path, table)
    roles = {site.node: site.role for site in sites}
    for match in replace_linears(gm, kind, targets):
        role = roles[match.nodes_map[match.anchor]]
        counts[f"replaced_{role}"] = counts.get(f"replaced_{role}", 0) + 1
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for site in sites:
        for attr in (site.weight, site.bias):
            if attr and attr not in used and site.module_path in tables:
                table = tables[site.module_path]
                replacement = table if attr == site.weight else table.get("bias")
                ledger.drop(gm, attr, by=owner, how=how, replacement=replacement)
    gm.recompile()
    counts["replaced"] = sum(v for k, v in counts.items() if k.startswith("replaced_"))
    counts["bytes_before"], counts["bytes_after"] = bytes_before, bytes_after
    return counts


def released_tables(ledger: WeightLedger, gm: fx.GraphModule, paths: Sequence[str], owner: Pass
                    ) -> Optional[Dict[str, Dict[str, torch.Tensor]]]:
    """Lowering again after the weights of ``paths`` were released: the tables ``owner`` made then (PassError
    if only some were released, or by another pass / configuration); None when none was released."""
    recs = {p: ledger.released(gm, f"{p}.weight") for p in paths}
    if not any(recs.values()):
        return None
    whole = [p for p, r in recs.items() if r is None]
    if whole:
        some = next(r for r in recs.values() if r is not None)
        raise PassError(refusal(some, f"{owner.name} now also selects {whole[:3]}, whose weights are whole, "
                                      f"and needs the released ones whole again to quantize them alike"))
    return {p: ledger.reuse(r, by=owner) for p, r in recs.items()}


# --------------------------------------------------------------------------------------- passes
class _QuantizeLinears(Pass):
    """Shared flow of the three passes: select, (calibrate), prepare, (save), substitute."""

    phase = Phase.QUANTIZE
    reads = ("structure",)
    invalidates = ("structure",)
    kind = ""
    needs_group_k = False

    def __init__(self, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None, serialize_to=None):
        self.include = _check_patterns("include", include)
        self.exclude = _check_patterns("exclude", exclude) or ()
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"filter_fn must be callable(module_path, role) -> bool, got {filter_fn!r}")
        self.filter_fn = filter_fn
        if serialize_to is not None and not isinstance(serialize_to, (str, bytes)) and not hasattr(serialize_to, "__fspath__"):
            raise TypeError(f"serialize_to must be a directory path, got {serialize_to!r}")
        self.serialize_to = None if serialize_to is None else str(serialize_to)

    # subclasses: quant_type(), config(), prepare(path, weight, bias, absmax) -> tensors
    def quant_type(self) -> str:
        raise NotImplementedError

    def config(self) -> Dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "quant_type": self.quant_type()}

    def config_items(self) -> Dict[str, Any]:
        return {"quant_type": self.quant_type(), "include": self.include, "exclude": self.exclude,
                "serialize_to": self.serialize_to}

    def calibrate(self, weights: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        return None

    def prepare(self, path: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
                absmax: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def _state(self, ctx: PassContext) -> Dict[str, Any]:
        return ctx.runtime.state.setdefault(self.name, {})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.frontend != "export":
            raise PassError(f"{self.name} rewrites weights, which the {ctx.frontend!r} front end passes as graph "
                            "inputs: use compile_dit(model, passes=[...]) instead of the torch.compile backend")
        structure = get_structure(gm)
        sites = select_linears(structure, self.include, self.exclude, self.filter_fn)
        notes: List[str] = []
        skipped = 0
        if self.needs_group_k:
            bad = [s for s in sites if s.in_features % GROUP_SIZE]
            if bad and self.include is not None:
                raise PassError(f"{self.name}: include= selected linears whose K is not a multiple of {GROUP_SIZE}, "
                                f"which W4A4 cannot quantize: {[(s.module_path, s.in_features) for s in bad][:5]}; "
                                "narrow include= or add them to exclude=")
            if bad:
                paths = sorted({s.module_path for s in bad})
                skipped = len(paths)
                notes.append(f"skipped {len(paths)} linear(s) with K % {GROUP_SIZE} != 0 "
                             f"(e.g. {paths[0]} K={bad[0].in_features})")
            sites = [s for s in sites if s.in_features % GROUP_SIZE == 0]
        if not sites:
            return PassResult(False, {"replaced": 0, "skipped_k": skipped}, "no eligible linear in the blocks; " + "; ".join(notes))
        paths = list(dict.fromkeys(s.module_path for s in sites))
        weights = {s.module_path: tensor_at(gm, s.weight) for s in sites}
        biases = {s.module_path: tensor_at(gm, s.bias) if s.bias else None for s in sites}
        ledger = ctx.runtime.weights
        tables = released_tables(ledger, gm, paths, self)
        if tables is not None:  # lowering again, the full weights released: the tables made the first time
            tables, how = place_tables(tables, weights[paths[0]]), "prepared weights reused, originals released"
        elif any(source_name(w) is not None for w in weights.values()):  # built on meta: from the checkpoint
            tables, how = self._tables_from_source(ctx, gm, paths, weights, biases, graph_block_lists(structure))
        else:
            signature = quant_signature(gm, paths, graph_block_lists(structure))
            tables, how = self._tables(ctx, paths, weights, biases, signature, notes)
        counts = apply_quantized(gm, sites, tables, self.kind, ledger, self)
        counts["skipped_k"] = skipped
        ratio = counts["bytes_after"] / max(counts["bytes_before"], 1)
        report = (f"{self.quant_type()}: {counts['replaced']} linear node(s) over {len(paths)} module(s) "
                  f"({how}); {counts['bytes_before']} -> {counts['bytes_after']} bytes ({ratio:.2f}x)")
        return PassResult(True, counts, "; ".join([report] + notes))

    def _tables_from_source(self, ctx, gm, paths, weights, biases, block_lists):
        """A model built on the meta device (``compile_dit(weights=...)``): each linear's weight and bias are read
        from the checkpoint, its table prepared and the full weight dropped, one linear at a time, so preparing
        holds the tables made so far plus one full weight. The fingerprint is taken while each weight is read."""
        if getattr(self, "calibrate_fn", None) is not None:
            raise PassError(f"{self.name}: calibrate_fn runs the model, whose weights are on the meta device (read "
                            f"from the checkpoint only while lowering): quantize with dynamic=True, or calibrate "
                            f"a loaded model once with serialize_to= and load that with dit_passes.load")
        source = ctx.runtime.weights.source

        def read(t: Optional[torch.Tensor], what: str) -> Optional[torch.Tensor]:
            name = source_name(t)
            if name is None:
                return t
            check_shape(source, name, t.shape, f"{self.name} (module {what})")
            return source.read(name, dtype=t.dtype, device=t.device)
        tables = {}
        for p in paths:
            full = read(weights[p], p)
            if full is not weights[p]:
                setattr(weights[p], SAMPLE, weight_sample(full))  # what quant_signature hashes
            tables[p] = self.prepare(p, full, read(biases[p], p), None)
            del full
        signature = quant_signature(gm, paths, block_lists)
        if self.serialize_to is not None:
            flat = {f"{p}.{f}": t for p, tab in tables.items() for f, t in tab.items()}
            save_quantized(self.serialize_to, flat, self.config(), signature)
        w0 = weights[paths[0]]
        key = (self.describe(), signature["weights_sha256"], tuple(paths))
        self._state(ctx)[key] = self._state(ctx)[(key, w0.device, w0.dtype)] = tables
        return tables, "read from the checkpoint one linear at a time, no calibration"

    def _tables(self, ctx, paths, weights, biases, signature, notes):
        state = self._state(ctx)
        key = (self.describe(), signature["weights_sha256"], tuple(paths))
        w0 = weights[paths[0]]
        placed = (key, w0.device, w0.dtype)
        if placed in state:
            return state[placed], "prepared weights reused"
        if key in state:  # prepared before, with the model on another device / in another dtype
            state[placed] = place_tables(state[key], w0)
            return state[placed], "prepared weights reused, moved"
        if state.get("calibrating"):
            raise PassError(f"{self.name}: calibrate_fn called the CompiledDiT that is being lowered. Calibrate "
                            "with the original transformer in the pipeline, or lower first: "
                            "compile_dit(model, passes=[...], example_inputs=...)")
        state["calibrating"] = True
        try:
            stats = self.calibrate(weights)
        finally:
            state.pop("calibrating", None)
        if stats is not None:
            missing = [p for p in paths if p not in stats]
            if len(missing) == len(paths):
                raise PassError(f"{self.name}: calibrate_fn() ran none of the {len(paths)} linears to quantize "
                                f"(e.g. {paths[0]}): it must call the model passed to compile_dit, e.g. through "
                                "a pipeline holding that transformer")
            if missing:
                notes.append(f"{len(missing)} linear(s) never ran during calibration (e.g. {missing[0]}): "
                             "weight-only smoothing for them")
        tables = {}
        for p in paths:
            absmax = None if stats is None else stats.get(p)
            tables[p] = self.prepare(p, weights[p], biases[p], absmax)
        if self.serialize_to is not None:
            flat = {f"{p}.{f}": t for p, tab in tables.items() for f, t in tab.items()}
            written = save_quantized(self.serialize_to, flat, self.config(), signature)
            notes.append(f"saved to {written}")
        state[key] = state[placed] = tables
        return tables, "calibrated" if stats is not None else "no calibration"


class SVDQuantW4A4(_QuantizeLinears):
    """SVDQuant W4A4 (int4 weights and activations, group 64, a low-rank branch of ``rank`` in the
    activation dtype). PTQ: ``calibrate_fn`` (zero-argument callable running the model on a few prompts)
    gives activation-aware smoothing ``s = act_absmax**alpha / w_absmax**(1-alpha)``; ``serialize_to``
    (a directory) is required and receives ``svdq_int4_r<rank>.safetensors`` + ``.json``. DQ
    (``dynamic=True``): no calibration, smoothing from the weights only (``smooth="weight"``) unless
    ``smooth`` says otherwise; ``serialize_to`` optional (``svdq_int4_r<rank>_dq``). The linears call
    ``dit_passes.svdq_w4a4_linear`` (true W4A4), or on Hopper (and anywhere with ``DIT_PASSES_W4A4_BACKEND=fp8``)
    are written as W4A8 on fp8 tensor cores (``quant/graph_forms.svdq_fp8_linear_form``: the same stored tensors)."""

    name = "svdquant_w4a4"
    kind = "svdq_w4a4"
    needs_group_k = True

    def __init__(self, rank: int = 32, calibrate_fn: Optional[Callable[[], Any]] = None, dynamic: bool = False,
                 alpha: float = 0.5, serialize_to=None, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None,
                 smooth: Optional[str] = None, seed: int = 0):
        super().__init__(include, exclude, filter_fn, serialize_to)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int (e.g. 32), got {rank!r}")
        if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
        if dynamic and calibrate_fn is not None:
            raise ValueError("dynamic=True quantizes without calibration: drop calibrate_fn, or set dynamic=False for PTQ")
        if not dynamic:
            if calibrate_fn is None:
                raise ValueError("SVDQuantW4A4 PTQ needs calibrate_fn, a zero-argument callable that runs the model "
                                 "on a few prompts; or pass dynamic=True to quantize without calibration")
            if not callable(calibrate_fn):
                raise TypeError(f"calibrate_fn must be a zero-argument callable, got {calibrate_fn!r}")
            if self.serialize_to is None:
                raise ValueError("SVDQuantW4A4 PTQ needs serialize_to=<directory>: calibration is costly, and the "
                                 "result is reloaded with dit_passes.load(model, <directory>)")
        smooth = smooth if smooth is not None else ("weight" if dynamic else "act")
        if smooth not in SMOOTH_MODES:
            raise ValueError(f"smooth must be one of {SMOOTH_MODES}, got {smooth!r}")
        if smooth == "act" and dynamic:
            raise ValueError("smooth='act' needs activation statistics, which dynamic=True does not collect")
        if not dynamic and smooth != "act":
            raise ValueError(f"PTQ calibrates for activation-aware smoothing (smooth='act'); with smooth={smooth!r} "
                             "the statistics would go unused: pass dynamic=True instead")
        self.rank, self.calibrate_fn, self.dynamic = rank, calibrate_fn, bool(dynamic)
        self.alpha, self.smooth, self.seed = float(alpha), smooth, int(seed)

    def quant_type(self) -> str:
        return f"svdq_int4_r{self.rank}" + ("_dq" if self.dynamic else "")

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "rank": self.rank, "alpha": self.alpha, "smooth": self.smooth,
                "dynamic": self.dynamic, "group_size": GROUP_SIZE, "seed": self.seed}

    def config_items(self) -> Dict[str, Any]:
        fn = getattr(self.calibrate_fn, "__qualname__", repr(self.calibrate_fn)) if self.calibrate_fn else None
        return {"rank": self.rank, "dynamic": self.dynamic, "alpha": self.alpha, "smooth": self.smooth,
                "calibrate_fn": fn, **super().config_items()}

    def calibrate(self, weights):
        if self.calibrate_fn is None:
            return None
        stats = calibrate_linears(weights, self.calibrate_fn)
        bad = [p for p, a in stats.items() if not torch.isfinite(a).all()]
        if bad:
            raise PassError(f"{self.name}: calibration saw inf/nan inputs at {bad[:3]}; check the calibration prompts")
        return stats

    def prepare(self, path, weight, bias, absmax):
        smooth = self.smooth if (absmax is not None or self.smooth != "act") else "weight"
        q = prepare_svdquant(weight, bias, act_absmax=absmax, rank=self.rank, alpha=self.alpha, smooth=smooth,
                             seed=self.seed, dtype=weight.dtype)
        return q.tensors()


class Fp8Linear(_QuantizeLinears):
    """fp8 e4m3 weights, dynamic fp8 activations (per token and row, or one scale each: ``granularity``), written
    as plain ATen ops (module docstring). ``exclude=()`` also takes the AdaLN modulation linears."""

    name = "fp8_linear"

    def __init__(self, granularity: str = "per_row", include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None,
                 serialize_to=None):
        super().__init__(include, exclude, filter_fn, serialize_to)
        if granularity not in FP8_GRANULARITIES:
            raise ValueError(f"granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}")
        self.granularity = granularity
        self.kind = f"fp8_{granularity}"

    def quant_type(self) -> str:
        return f"fp8_e4m3_{self.granularity}"

    def prepare(self, path, weight, bias, absmax):
        return prepare_fp8(weight, bias, self.granularity).tensors()


class Int8Linear(_QuantizeLinears):
    """int8 weights (symmetric per row) and dynamic per-token int8 activations, int32 accumulation."""

    name = "int8_linear"
    kind = "int8_per_row"

    def quant_type(self) -> str:
        return "int8_per_row"

    def prepare(self, path, weight, bias, absmax):
        return prepare_int8(weight, bias).tensors()

