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
``patterns/quant_linear.py``) -- so that torch.compile fuses the quantization into x's producer; their other
options, ``quantize_8bit.py``: ``Int8Linear(granularity="per_tensor")`` calls ``dit_passes.int8_tensor_linear``,
``Fp8Linear("per_block")`` ``dit_passes.fp8_block_linear``, ``weight_only=True`` writes the weight-only form of
``weight_only_forms.w8a16_linear_form`` with int8 / e4m3 weights)::

    qw = self.transformer_blocks.0.attn.to_q.qweight        # uint8 [N, K/2], two int4 per byte
    ws = self.transformer_blocks.0.attn.to_q.wscale         # bf16 [N, K/64]
    ld = self.transformer_blocks.0.attn.to_q.lora_down      # [rank, K]
    lu = self.transformer_blocks.0.attn.to_q.lora_up        # [N, rank]
    si = self.transformer_blocks.0.attn.to_q.smooth_inv     # fp32 [K]
    b  = self.transformer_blocks.0.attn.to_q.bias
    q = torch.ops.dit_passes.svdq_w4a4_linear.default(norm_x, qw, ws, ld, lu, si, b)

The AdaLN modulation linears (role ``modulation``: their input is the conditioning vector, one row per sample)
under SVDQuantW4A4 get a weight-only form by default (``modulation="w4a16_lr"``: int4 weights per group of 64 of
the residual after SVDQuant's rank-``rank`` low-rank branch, the branch beside it in the activation dtype, the
activations left in their dtype, as plain ATen ops; ``quant/weight_only_forms.w4a16_lr_linear_form``)::

    w = self.transformer_blocks.0.norm1.linear.qweight      # uint8 [N, K/2], two int4 per byte
    ws = self.transformer_blocks.0.norm1.linear.wscale      # bf16 [N, K/64]
    deq = aten.type_as(<unpacked w, times ws per group>, emb)
    mod = aten.add(aten.linear(emb, deq, b), aten.linear(aten.linear(emb, lora_down), lora_up))

``modulation="w8a16"`` gives them weight-only int8 per output row (``weight_only_forms.w8a16_linear_form``; also what a
modulation linear whose K is not a multiple of 64 gets under the int4 forms), ``"w4a16"`` weight-only int4 without
the branch (``weight_only_forms.w4a16_linear_form``), ``"svdq"`` W4A4 like the rest, ``None`` leaves them unquantized;
Fp8Linear and Int8Linear quantize them in their own form.

Which linears: those of ``structure.linears`` inside a block (prologue/epilogue embedders and the final
projection stay; ``regional=False``: every linear of the graph; ``block_classes=("FluxTransformerBlock", ...)``:
those inside a module of these class names, by the node's ``nn_module_stack``), minus ``exclude`` (default: none), restricted to ``include`` when given, then
``filter_fn(module_path, role)``; a linear an earlier quantization pass already rewrote is never taken again. An
include/exclude entry that is a role name (``q``, ``mlp_up``, ...) matches that role; any other string matches
module paths containing it. int4 (W4A4, W4A16) needs K % 64 == 0, and no kind quantizes K = 0 (an empty reduction):
such linears stay in their original precision, counted (``skipped_k``) and listed with the reason in the report
(``explain()``), or are refused when ``include`` named them (W8A16 takes any K > 0, and takes the modulation
linears int4 cannot group). ``counts``: ``replaced`` (linear nodes quantized), ``considered`` (every linear of the
graph) and, for the others, ``skipped_<reason>`` (``quantize_select.SKIP_REASONS``: outside the blocks, excluded,
refused by ``filter_fn``, ...; ``skipped_k`` for the K rule): considered = replaced + the skipped ones (few-shot's
linears that never ran while observed are in the report's notes). A pass that
quantizes no linear leaves the graph as it is, returns changed=False with those reasons in its report, and warns
(``warnings.warn``): such a model runs in its original precision, which looks like a quantization that worked.
``verbose=True`` prints each linear with the kind it became or why it was left.

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

import dataclasses
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..analysis.blocks import get_structure
from ..infra.ownership import SAMPLE, weight_sample
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..infra.weight_source import read_whole, source_name
from ..quant.calibrate import ActAbsMaxObserver
from ..quant.forms import DEFAULT_FORMS, QuantForms
from ..quant.int4 import GROUP_SIZE
from ..quant.nvfp4 import BLOCK as NVFP4_BLOCK, prepare_svdquant_nvfp4
from ..quant.serialize import save_quantized
from ..quant.signature import FORMAT, graph_block_lists, place_tables, quant_signature, tensor_at
from ..quant.w4_lut import lut_storage
from ..quant.svdquant import SMOOTH_MODES, SVD_PRECISIONS, prepare_svdquant
from ..quant.w4a16 import prepare_w4a16, prepare_w4a16_lr
from ..quant.w8a16 import prepare_w8a16

from ..patterns.quant_linear import QUANT_KINDS
from .quantize_fused import fused_members, fused_note, low_rank_of
from .quantize_graph import apply_by_kind, releasable_weights, released_tables
from .quantize_select import (DEFAULT_EXCLUDE, ROLE_NAMES, SKIP_REASONS, check_patterns,  # noqa: F401
                              inside_classes, select_linears)

W8A16, W4A16, W4A16_LR = "w8a16", "w4a16", "w4a16_lr"
WEIGHT_ONLY = (W8A16, W4A16, W4A16_LR)
WEIGHT_ONLY_KINDS = (*WEIGHT_ONLY, "fp8_weight_only", "nvfp4_weight_only")  # the kinds weight_only_form acts on
MODULATION_FORMS = (W8A16, W4A16, W4A16_LR, "svdq", None)
# SVDQuant's 4-bit format (cache-dit's ``precision``) -> the quantized kind its linears get
PRECISIONS = {"int4": "svdq_w4a4", "nvfp4": "svdq_nvfp4"}


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


# --------------------------------------------------------------------------------------- passes
class _QuantizeLinears(Pass):
    """Shared flow of the three passes: select, (calibrate), prepare, (save), substitute."""

    phase = Phase.QUANTIZE
    reads = ("structure", "fused_linears")  # fused_linears: the members a checkpoint's signature records
    invalidates = ("structure",)
    kind = ""

    def __init__(self, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None, serialize_to=None, regional=True,
                 block_classes=None, verbose: bool = False, weight_only_form: str = "auto"):
        # how the linears are written (forms.QuantForms; a subclass sets the fields it takes): in describe(), so in
        # every key a lowered graph or a prepared table is cached under
        self.forms: QuantForms = QuantForms(weight_only_form=weight_only_form)
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, got {verbose!r}")
        self.verbose = verbose  # print, per linear, what it became or why it was left (cache-dit's verbose summary)
        self.include = check_patterns("include", include)
        self.regional = bool(regional)
        self.block_classes = check_patterns("block_classes", block_classes)
        self.exclude = check_patterns("exclude", exclude) or ()
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"filter_fn must be callable(module_path, role) -> bool, got {filter_fn!r}")
        self.filter_fn = filter_fn
        if serialize_to is not None and not isinstance(serialize_to, (str, bytes)) and not hasattr(serialize_to, "__fspath__"):
            raise TypeError(f"serialize_to must be a directory path, got {serialize_to!r}")
        self.serialize_to = None if serialize_to is None else str(serialize_to)
        # the fused linears of the graph being lowered (quantize_fused.fused_members), set by run() before any table
        # is made: prepare() and _save() read it
        self._fused: Dict[str, List[List[Any]]] = {}

    # subclasses: quant_type(), config(), prepare(path, weight, bias, absmax, kind) -> tensors, kind_of(site),
    # k_multiple(kind)
    def quant_type(self) -> str:
        raise NotImplementedError

    def kind_of(self, site) -> str:
        """The quantized kind a selected linear gets (``QUANT_KINDS``): the pass's own unless a subclass says."""
        return self.kind

    def k_multiple(self, kind: str) -> int:
        """The group K must be a multiple of for ``kind`` (int4: ``GROUP_SIZE``; NVFP4: 16; 1: any K)."""
        return 1

    def cannot_quantize(self, site) -> Optional[str]:
        """Why the linear of ``site`` stays unquantized (its kind's arithmetic: an empty K has no scale to take, a
        group must divide K), None if it can be quantized."""
        kind, k = self.kind_of(site), site.in_features
        if k <= 0:
            return f"K = {k} (no input features: nothing to quantize)"
        group = self.k_multiple(kind)
        if k % group:
            return f"K % {group} != 0 ({kind} takes K in groups of {group}: it needs a multiple of {group})"
        return None

    def config(self) -> Dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "quant_type": self.quant_type()}

    def config_items(self) -> Dict[str, Any]:
        return {"quant_type": self.quant_type(), "include": self.include, "exclude": self.exclude,
                "regional": self.regional, "block_classes": self.block_classes, "serialize_to": self.serialize_to,
                **({"verbose": True} if self.verbose else {}), **self.forms.items()}

    def writes_weight_only(self) -> bool:
        """Whether some linear may get a weight-only kind (where ``weight_only_form`` acts)."""
        return self.kind in WEIGHT_ONLY_KINDS

    def check_forms(self, unused: Dict[str, str]) -> None:
        """Refuse a form setting this pass would not act on (``unused``: field -> why), rather than drop it."""
        if self.forms.weight_only_form != "auto" and not self.writes_weight_only():
            unused = {**unused, "weight_only_form": "it writes no weight-only linear"}
        bad = {k: why for k, why in unused.items() if getattr(self.forms, k) != getattr(DEFAULT_FORMS, k)}
        if bad:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(
                f"{k}={getattr(self.forms, k)!r} has no effect here ({why})" for k, why in bad.items()))

    def calibrate(self, weights: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        return None

    def calibrate_in(self, ctx: PassContext, weights: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """The activation statistics for ``weights`` (:meth:`calibrate`; a subclass may read them from the runtime)."""
        return self.calibrate(weights)

    def before_quantize(self, gm: fx.GraphModule, ctx: PassContext, sites: List[Any],
                        notes: List[str]) -> Optional[PassResult]:
        """Called with the selected sites before any table is made: a PassResult ends the pass there (the graph left
        as it is then); ``sites`` may be narrowed in place. Default: nothing."""
        return None

    def prepare(self, path: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
                absmax: Optional[torch.Tensor], kind: str) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def stored_form(self, tables: Dict[str, Dict[str, torch.Tensor]], kinds: Dict[str, str]) -> Dict[str, str]:
        """The kinds the graph writes for ``tables`` as the device of their tensors stores them: a subclass may turn
        a kind's tensors into a device-specific form, replacing ``tables``' entries in place (the pass's state then
        holds that form alone: each weight held once). Default: as prepared."""
        return kinds

    def _state(self, ctx: PassContext) -> Dict[str, Any]:
        return ctx.runtime.state.setdefault(self.name, {})

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.frontend != "export":
            raise PassError(f"{self.name} rewrites weights, which the {ctx.frontend!r} front end passes as graph "
                            "inputs: use compile_dit(model, passes=[...]) instead of the torch.compile backend")
        structure = get_structure(gm)
        left: Dict[str, int] = {}  # linears the selection left, by reason (SKIP_REASONS)
        left_by_path: Dict[str, str] = {}  # ... and each one's reason, for verbose
        sites = select_linears(structure, self.include, self.exclude, self.filter_fn, self.regional, self.block_classes,
                               skipped=left, why=left_by_path)
        if self.block_classes is not None and not any(inside_classes(s, self.block_classes) for s in structure.linears):
            raise PassError(f"{self.name}: block_classes={list(self.block_classes)}: no linear of the graph lies inside "
                            f"a module of these classes (the block lists found: "
                            f"{[bl.cls.rsplit('.', 1)[-1] for bl in structure.block_lists]})")
        notes: List[str] = []
        bad = {s.module_path: (why, s.in_features) for s in sites if (why := self.cannot_quantize(s)) is not None}
        if bad and self.include is not None:
            raise PassError(f"{self.name}: include= selected linears it cannot quantize: "
                            f"{[f'{p} (K={k}): {why}' for p, (why, k) in bad.items()][:5]}; narrow include= or add "
                            "them to exclude=")
        skipped = len(bad)
        if bad:  # left in their original precision, the model still quantized around them
            by_reason: Dict[str, List[str]] = {}
            for path, (why, k) in bad.items():
                by_reason.setdefault(why, []).append(f"{path} K={k}")
            notes.append(f"left {skipped} linear(s) in their original precision: " + "; ".join(
                f"{len(ps)} with {why} (e.g. {', '.join(ps[:3])})" for why, ps in by_reason.items()))
            sites = [s for s in sites if s.module_path not in bad]
        if skipped:
            left["k"] = skipped
            left_by_path.update({p: f"k: {reason}" for p, (reason, _) in bad.items()})
        if not sites:
            return self._nothing_quantized(structure, left, notes, left_by_path)
        early = self.before_quantize(gm, ctx, sites, notes)  # a subclass may observe instead, or drop sites
        if early is not None:
            return early
        if not sites:
            return self._nothing_quantized(structure, left, notes, left_by_path)
        paths = list(dict.fromkeys(s.module_path for s in sites))
        self._fused = fused_members(gm, paths)
        kinds = {s.module_path: self.kind_of(s) for s in sites}
        weights = {s.module_path: tensor_at(gm, s.weight) for s in sites}
        biases = {s.module_path: tensor_at(gm, s.bias) if s.bias else None for s in sites}
        ledger = ctx.runtime.weights
        tables = released_tables(ledger, gm, paths, self)
        if tables is not None:  # lowering again, the full weights released: the tables made the first time
            tables, how = place_tables(tables, weights[paths[0]]), "prepared weights reused, originals released"
        elif any(source_name(w) is not None for w in weights.values()):  # built on meta: from the checkpoint
            tables, how = self._tables_from_source(ctx, gm, paths, kinds, weights, biases, graph_block_lists(structure),
                                                   notes)
        else:
            signature = quant_signature(gm, paths, graph_block_lists(structure), self._fused)
            releasable = releasable_weights(gm, sites) if ledger.model is not None else {}

            def release(path: str, table: Dict[str, torch.Tensor]) -> None:
                # the table exists: the original weight leaves the graph and the user's model now, not after the
                # last linear, so preparing holds the model and the result only one linear's worth at a time
                if path in releasable and ledger.release_now(gm, releasable[path], table, by=self,
                                                             how=f"quantized ({kinds[path]})"):
                    weights[path] = tensor_at(gm, releasable[path])  # its stand-in: shape and dtype, no values
            tables, how = self._tables(ctx, paths, kinds, weights, biases, signature, notes, release)
        kinds = self.stored_form(tables, kinds)
        counts = apply_by_kind(gm, sites, kinds, tables, ledger, self, self.forms)
        counts["considered"] = len(structure.linears)
        counts["skipped_k"] = skipped
        counts.update({f"skipped_{r}": n for r, n in left.items() if r != "k"})
        if self._fused:
            counts["fused_linears"] = len(self._fused)
            notes.append(fused_note(self._fused, tables))
        # the kernels dispatch chose over ATen ops (act_quant="kernel", w4_expand="kernel": the defaults on sm_89+)
        for op, key, what in ((torch.ops.dit_passes.fp8_quantize_rows.default, "act_quant_ops",
                               "activation quantization(s) as dit_passes::fp8_quantize_rows"),
                              (torch.ops.dit_passes.w4_to_e4m3.default, "w4_expand_ops",
                               "int4 weight expansion(s) as dit_passes::w4_to_e4m3")):
            count = sum(n.target is op for n in gm.graph.nodes)
            if count:
                counts[key] = count
                notes.append(f"{count} {what}")
        ratio = counts["bytes_after"] / max(counts["bytes_before"], 1)
        per_kind = ", ".join(f"{k[len('kind_'):]} {v}" for k, v in counts.items() if k.startswith("kind_"))
        report = (f"{self.quant_type()}: {counts['replaced']} linear node(s) over {len(paths)} module(s) "
                  f"[{per_kind}] ({how}); {counts['bytes_before']} -> {counts['bytes_after']} bytes ({ratio:.2f}x)")
        kept = _left_text({r: n for r, n in left.items() if r != "k"})  # the K reasons are in notes, with examples
        if kept:
            report += f"; of {counts['considered']} linear(s), left unquantized: {kept}"
        if self.verbose:
            self._print_table(structure, {s.module_path: kinds[s.module_path] for s in sites}, left_by_path, report)
        return PassResult(True, counts, "; ".join([report] + notes))

    def _print_table(self, structure, done: Dict[str, str], why: Dict[str, str], headline: str) -> None:
        """``verbose``: each linear of the graph, graph order, with the kind it became or why it was left."""
        rows = []
        for site in structure.linears:
            p = site.module_path
            if p in done:
                rows.append((p, done[p]))
            elif p in why:
                key, _, detail = why[p].partition(": ")
                rows.append((p, "left: " + (detail if key == "k" else SKIP_REASONS.get(key, key))))
        width = max((len(p) for p, _ in rows), default=0)
        print(f"[dit_passes] {self.name}: {headline}\n" + "\n".join(f"  {p:<{width}}  {what}" for p, what in rows))

    def _nothing_quantized(self, structure, left: Dict[str, int], notes: List[str], why: Dict[str, str]) -> PassResult:
        """No linear to quantize: the graph is left as it is, and the caller is told why (a warning, the report and
        the ``skipped_<reason>`` counts), since a quantization that changed nothing looks like one that worked."""
        considered = len(structure.linears)
        counts = {"replaced": 0, "considered": considered, "skipped_k": left.get("k", 0),
                  **{f"skipped_{r}": n for r, n in left.items() if r != "k"}}
        reasons = _left_text(left) if considered else "the graph has no linear"
        report = (f"{self.quant_type()}: quantized no linear: of {considered} linear(s) considered, left "
                  f"unquantized: {reasons}")
        report = "; ".join([report] + notes)
        warnings.warn(f"{self.name}: {report}; the model runs in its original precision", stacklevel=2)
        if self.verbose:
            self._print_table(structure, {}, why, report)
        return PassResult(False, counts, report)

    def _tables_from_source(self, ctx, gm, paths, kinds, weights, biases, block_lists, notes):
        """A model built on the meta device (``compile_dit(weights=...)``): each linear's weight and bias are read
        from the checkpoint, its table prepared and the full weight dropped, one linear at a time, so preparing
        holds the tables made so far plus one full weight. The fingerprint is taken while each weight is read."""
        if getattr(self, "calibrate_fn", None) is not None:
            raise PassError(f"{self.name}: calibrate_fn runs the model, whose weights are on the meta device (read "
                            f"from the checkpoint only while lowering): quantize with dynamic=True, or calibrate "
                            f"a loaded model once with serialize_to= and load that with dit_passes.load")
        source = ctx.runtime.weights.source

        def read(t: Optional[torch.Tensor], what: str) -> Optional[torch.Tensor]:
            return read_whole(source, t, f"{self.name} (module {what})")
        tables = {}
        for p in paths:
            full = read(weights[p], p)
            if full is not weights[p]:
                setattr(weights[p], SAMPLE, weight_sample(full))  # what quant_signature hashes
            tables[p] = self.prepare(p, full, read(biases[p], p), None, kinds[p])
            del full
        signature = quant_signature(gm, paths, block_lists, self._fused)
        self._save(tables, kinds, signature, notes)
        w0 = weights[paths[0]]
        key = (self.describe(), signature["weights_sha256"], tuple(paths))
        self._state(ctx)[key] = self._state(ctx)[(key, w0.device, w0.dtype)] = tables
        return tables, "read from the checkpoint one linear at a time, no calibration"

    def _tables(self, ctx, paths, kinds, weights, biases, signature, notes, release=None):
        """The tables of ``paths`` (reused from an earlier lowering when the weights match, else calibrated and
        prepared); ``release(path, table)`` is called as each table is made (see ``run``)."""
        state = self._state(ctx)
        key = (self.describe(), signature["weights_sha256"], tuple(paths))
        w0 = weights[paths[0]]
        placed = (key, w0.device, w0.dtype)
        if placed in state:
            return state[placed], "prepared weights reused"
        if key in state:  # prepared before, with the model on another device / in another dtype
            state[placed] = place_tables(state[key], w0)
            return state[placed], "prepared weights reused, moved"
        del w0  # a name holding the first weight would keep it past its release
        if state.get("calibrating"):
            raise PassError(f"{self.name}: calibrate_fn called the CompiledDiT that is being lowered. Calibrate "
                            "with the original transformer in the pipeline, or lower first: "
                            "compile_dit(model, passes=[...], example_inputs=...)")
        # activation statistics serve the pass's own kind only (W8A16 / W4A16 leave the activations alone)
        observed = [p for p in paths if kinds[p] == self.kind]
        state["calibrating"] = True
        try:
            stats = self.calibrate_in(ctx, {p: weights[p] for p in observed}) if observed else None
        finally:
            state.pop("calibrating", None)
        if stats is not None:
            missing = [p for p in observed if p not in stats]
            if len(missing) == len(observed):
                raise PassError(f"{self.name}: calibrate_fn() ran none of the {len(observed)} linears to quantize "
                                f"(e.g. {observed[0]}): it must call the model passed to compile_dit, e.g. through "
                                "a pipeline holding that transformer")
            if missing:
                notes.append(f"{len(missing)} linear(s) never ran during calibration (e.g. {missing[0]}): "
                             "weight-only smoothing for them")
        tables = {}
        for p in paths:
            absmax = None if stats is None else stats.get(p)
            tables[p] = self.prepare(p, weights[p], biases[p], absmax, kinds[p])
            if release is not None:
                release(p, tables[p])
        self._save(tables, kinds, signature, notes)
        state[key] = state[placed] = tables
        return tables, "calibrated" if stats is not None else "no calibration"

    def _save(self, tables, kinds, signature, notes) -> None:
        if self.serialize_to is None:
            return
        flat = {f"{p}.{f}": t for p, tab in tables.items() for f, t in tab.items()}
        config = self.config()
        other = {p: k for p, k in sorted(kinds.items()) if k != self.kind}
        if other:  # the linears whose kind is not config["kind"] (LoadQuantized reads it)
            config["kind_of"] = other
        ranks = low_rank_of(tables, self._fused)
        if ranks:  # fused linears: a low-rank branch per member (LoadQuantized checks the tensors' shapes against it)
            config["rank_of"] = ranks
        notes.append(f"saved to {save_quantized(self.serialize_to, flat, config, signature)}")


class SVDQuantW4A4(_QuantizeLinears):
    """SVDQuant W4A4 (int4 weights and activations, group 64, a low-rank branch of ``rank`` in the
    activation dtype). PTQ: ``calibrate_fn`` (zero-argument callable running the model on a few prompts)
    gives activation-aware smoothing ``s = act_absmax**alpha / w_absmax**(1-alpha)``; ``serialize_to``
    (a directory) is required and receives ``svdq_int4_r<rank>.safetensors`` + ``.json``. DQ
    (``dynamic=True``): no calibration, smoothing from the weights only (``smooth="weight"``) unless
    ``smooth`` says otherwise; ``serialize_to`` optional (``svdq_int4_r<rank>_dq``). The linears call
    ``dit_passes.svdq_w4a4_linear`` (true W4A4), or are written in another form as ``form`` asks.

    How the linears are written (``quant/forms.py``; each default, ``"auto"`` / ``None``, chosen per device by
    ``quant/dispatch.device_default``; a setting away from its default is in ``describe()``):

    * ``form``: ``"auto"`` (Hopper: ``"lut"`` where its library builds, else ``"lrcat_split"``; elsewhere ``"op"``),
      ``"op"`` (true W4A4, the reference numerics; ``"triton"`` / ``"cutlass"``: on that CUDA kernel), ``"fp8"``
      (W4A8 on fp8 tensor cores, ``quant/graph_forms.svdq_fp8_linear_form``: the same stored tensors), ``"lrcat"`` /
      ``"lrcat_split"`` (the low-rank branch in the fp8 GEMM's K), ``"w4a8"`` / ``"w4a8_fold"``
      (``dit_passes.svdq_w4a8_linear``: the fused W4A8 Triton kernels, no expanded weight buffer; ``quant/w4a8.py``),
      ``"lut"`` (the lookup-table GEMM's storage, ``quant/w4_lut.py``); ``precision="nvfp4"`` takes ``"auto"``,
      ``"op"`` or ``"fp8"``;
    * ``fast_accum`` (the fp8 GEMMs' ``use_fast_accum``), ``act_quant`` (``"graph"`` / ``"kernel"``: the per-token
      activation quantization as ATen ops or as dit_passes' row op), ``w4_expand`` (the int4 -> e4m3 weight
      expansion of the fp8 / lrcat forms, likewise), ``lrcat_act`` (``"mm"`` / ``"stats"``: the lrcat form's A
      operand), ``lut_planes`` (2 or 3: the LUT form's branch columns), ``lut_act`` (``"rows"`` / ``"lowrank"``: its A
      operand), ``weight_only_form`` (the modulation linears on a few rows: ``"linear"`` / ``"rows"`` /
      ``"kernel"``).

    ``svd_precision`` (``"low"``: seeded randomized SVD, ``"medium"``: full SVD in fp32, ``"high"``: in fp64) and
    ``refine_iters`` (rounds refitting the low-rank branch to what the residual's quantization leaves): cache-dit's
    ``calibrate_precision`` and ``svd_refine_iters`` (``svdquant.low_rank_split``).

    ``precision="nvfp4"``: the residual and the activations in NVFP4 instead (``quant/nvfp4.py``: e2m1 values, e4m3
    scales per 16 along K, an fp32 global scale; the checkpoint layout Blackwell reads), smoothing and the low-rank
    branch unchanged; quant type ``svdq_nvfp4_r<rank>[_dq]``. The linears call ``dit_passes.svdq_nvfp4_linear`` (the
    exact dequantization in fp32) or, on sm_89+ GPUs, the exact split GEMM on fp8 tensor cores
    (``graph_forms.svdq_nvfp4_fp8_linear_form``).

    ``modulation``: the form of the AdaLN modulation linears (role ``modulation``, about a quarter of FLUX's weights):
    ``"w4a16_lr"`` (default) weight-only int4 of the residual after a rank-``rank`` low-rank branch (SVDQuant's,
    unsmoothed, refit twice to the residual's int4 error; group scales searched for squared error: a quarter of the
    bytes plus the factors; ``quant/w4a16.py``); ``"w8a16"`` int8 weights per output row (half the bf16 bytes; any K:
    the int4 forms give it to a modulation linear whose K is not a multiple of 64); ``"w4a16"`` weight-only int4
    (W4A4's weights); ``"svdq"`` W4A4 like the other linears; ``None`` leaves them unquantized. The activations
    (the conditioning vector) stay in their dtype: quantizing them buys the GEMV no speed and costs the worst images
    (PSNR per form on the digits DiT: bench/results/quant_fidelity_w4a16lr_refined.md; FLUX.1-dev's bytes per form:
    flux_modulation_error.md). They are never calibrated.

    A linear ``FuseSiblingLinears`` made out of m siblings (graph fact ``fused_linears``: q / k / v, + ``proj_mlp`` in
    FLUX's single blocks) gets rank ``rank`` x m (its low-rank kinds: W4A4, NVFP4, W4A16_LR): at least the accuracy
    of the m members' own branches, at their down-projection cost but m times their up-projection's (a dense
    ``lora_up``; ``quantize_fused.py``); the report says e.g. "8 fused linear(s): 8 at rank 96", the checkpoint's
    ``config["rank_of"]`` lists them (its quant type keeps ``r<rank>``)."""

    name = "svdquant_w4a4"
    kind = "svdq_w4a4"

    def __init__(self, rank: int = 32, calibrate_fn: Optional[Callable[[], Any]] = None, dynamic: bool = False,
                 alpha: float = 0.5, serialize_to=None, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None,
                 smooth: Optional[str] = None, seed: int = 0, modulation: Optional[str] = W4A16_LR,
                 precision: str = "int4", regional: bool = True, block_classes=None, svd_precision: str = "low",
                 refine_iters: int = 0, verbose: bool = False, form: str = "auto", fast_accum: Optional[bool] = None,
                 act_quant: str = "auto", w4_expand: str = "auto", lrcat_act: str = "auto",
                 lut_planes: Optional[int] = None, lut_act: str = "auto", weight_only_form: str = "auto"):
        super().__init__(include, exclude, filter_fn, serialize_to, regional, block_classes, verbose, weight_only_form)
        self.forms = dataclasses.replace(self.forms, form=form, fast_accum=fast_accum, act_quant=act_quant,
                                         w4_expand=w4_expand, lrcat_act=lrcat_act, lut_planes=lut_planes,
                                         lut_act=lut_act)
        if svd_precision not in SVD_PRECISIONS:
            raise ValueError(f"svd_precision must be one of {SVD_PRECISIONS}, got {svd_precision!r}")
        if isinstance(refine_iters, bool) or not isinstance(refine_iters, int) or refine_iters < 0:
            raise ValueError(f"refine_iters must be a non-negative int, got {refine_iters!r}")
        self.svd_precision, self.refine_iters = svd_precision, refine_iters
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)} (the 4-bit format of the residual and the "
                             f"activations), got {precision!r}")
        self.precision, self.kind = precision, PRECISIONS[precision]
        if modulation not in MODULATION_FORMS:
            raise ValueError(f"modulation must be one of {MODULATION_FORMS} (the AdaLN modulation linears' form: "
                             f"weight-only int8 or int4, W4A4 like the rest, or unquantized), got {modulation!r}")
        self.modulation = modulation
        if modulation is None and "modulation" not in self.exclude:
            self.exclude = self.exclude + ("modulation",)
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
        self.check_forms(self._unused_forms())

    def writes_weight_only(self) -> bool:
        return self.modulation in WEIGHT_ONLY

    def _unused_forms(self) -> Dict[str, str]:
        """The form settings this configuration would not act on, with why."""
        f = self.forms.form
        if self.precision == "nvfp4":
            out = {k: "precision='nvfp4' has no LUT / lrcat / int4-expansion form"
                   for k in ("w4_expand", "lrcat_act", "lut_planes", "lut_act")}
            out["act_quant"] = "the NVFP4 fp8 form quantizes its activations in its own split"
            if f not in ("auto", "op", "fp8"):
                out["form"] = "precision='nvfp4' is written as 'op' or 'fp8' ('auto': fp8 where _scaled_mm runs)"
            return out
        out = {}
        if f not in ("auto", "lut"):
            out.update({k: f"form={f!r} is not the LUT form" for k in ("lut_planes", "lut_act")})
        if f not in ("auto", "lrcat", "lrcat_split"):
            out["lrcat_act"] = f"form={f!r} is not an lrcat form"
        if f not in ("auto", "fp8", "lrcat", "lrcat_split"):
            out["w4_expand"] = f"form={f!r} expands no int4 weight to e4m3"
        if f in ("op", "triton", "cutlass", "w4a8", "w4a8_fold"):
            out.update({k: f"form={f!r} runs no fp8 graph form" for k in ("fast_accum", "act_quant")})
        if f == "lut":
            out["fast_accum"] = "the LUT GEMM is not _scaled_mm"
        return out

    def quant_type(self) -> str:
        return f"svdq_{self.precision}_r{self.rank}" + ("_dq" if self.dynamic else "")

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "rank": self.rank, "alpha": self.alpha, "smooth": self.smooth,
                "dynamic": self.dynamic, "group_size": self.k_multiple(self.kind), "seed": self.seed,
                "modulation": self.modulation, "precision": self.precision, "svd_precision": self.svd_precision,
                "refine_iters": self.refine_iters}

    def config_items(self) -> Dict[str, Any]:
        fn = getattr(self.calibrate_fn, "__qualname__", repr(self.calibrate_fn)) if self.calibrate_fn else None
        return {"rank": self.rank, "dynamic": self.dynamic, "alpha": self.alpha, "smooth": self.smooth,
                "modulation": self.modulation, "precision": self.precision, "svd_precision": self.svd_precision,
                "refine_iters": self.refine_iters, "calibrate_fn": fn,
                **super().config_items()}

    def kind_of(self, site) -> str:
        if site.role != "modulation" or self.modulation not in WEIGHT_ONLY:
            return self.kind
        # int4 groups K by 64: a modulation linear it cannot group stays weight-only, in int8 (any K)
        return W8A16 if site.in_features % self.k_multiple(self.modulation) else self.modulation

    def k_multiple(self, kind: str) -> int:
        return {W8A16: 1, "svdq_nvfp4": NVFP4_BLOCK}.get(kind, GROUP_SIZE)

    def calibrate(self, weights):
        if self.calibrate_fn is None:
            return None
        stats = calibrate_linears(weights, self.calibrate_fn)
        bad = [p for p, a in stats.items() if not torch.isfinite(a).all()]
        if bad:
            raise PassError(f"{self.name}: calibration saw inf/nan inputs at {bad[:3]}; check the calibration prompts")
        return stats

    def stored_form(self, tables, kinds):
        """On a Hopper GPU where the LUT GEMM runs (``form="auto"``) or anywhere with ``form="lut"``, W4A4 tables
        become the lookup-table form where N is a multiple of 16 (``quant/w4_lut.lut_storage``: codes, tables, sw,
        c; qweight, wscale and lora_up are not kept), kind ``svdq_lut``."""
        return lut_storage(tables, kinds, self.forms.form)

    def rank_of(self, path: str) -> int:
        """The low-rank branch's rank for the linear at ``path``: ``rank`` per member of a fused linear."""
        return self.rank * max(1, len(self._fused.get(path, ())))

    def prepare(self, path, weight, bias, absmax, kind):
        if kind == W8A16:
            return prepare_w8a16(weight, bias).tensors()
        if kind == W4A16:
            return prepare_w4a16(weight, bias).tensors()
        if kind == W4A16_LR:
            return prepare_w4a16_lr(weight, bias, rank=self.rank_of(path), seed=self.seed,
                                    dtype=weight.dtype).tensors()
        smooth = self.smooth if (absmax is not None or self.smooth != "act") else "weight"
        prepare = prepare_svdquant_nvfp4 if kind == "svdq_nvfp4" else prepare_svdquant
        q = prepare(weight, bias, act_absmax=absmax, rank=self.rank_of(path), alpha=self.alpha, smooth=smooth,
                    seed=self.seed, dtype=weight.dtype, svd=self.svd_precision, refine_iters=self.refine_iters)
        return q.tensors()


def _left_text(left: Dict[str, int]) -> str:
    """``"3 outside the repeated blocks, 2 excluded ..."`` for the counts by reason (``"k"``: the kind's K rule)."""
    words = {**SKIP_REASONS, "k": "whose K the kind cannot take (which, below)"}
    return ", ".join(f"{n} {words.get(r, r)}" for r, n in left.items() if n)


# the torchao-style passes live beside (this file's size); re-exported here, where they have always been imported from
from .quantize_8bit import Fp8Linear, Int4WeightOnly, Int8Linear, NVFP4WeightOnly  # noqa: E402,F401
