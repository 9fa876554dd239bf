"""FuseSiblingLinears: linears that read one input become one wider linear and a split (opt-in).

Why: each linear of a quantized model quantizes its input again and runs its own GEMM; FLUX's q / k / v (and in
a single-stream block also ``proj_mlp``) read one normalised activation, and a 3072 x 3072 fp8 GEMM is slower
than bf16 once its activation quantization is counted while a wider one is faster. After this pass the
quantizers see one linear per group.

Contract: phase ``FUSE_LINEARS`` (after the sharding phases, before ``QUANTIZE``); reads ``structure`` (linear
roles) and invalidates it (the fused linear has role ``qkv``); writes ``fused_linears`` (each fused linear's path ->
its members' paths and rows: ``SVDQuantW4A4`` gives it rank ``rank`` x members, checkpoints record the members).
Export front end only (weights are graph attributes; on the Dynamo front end no linear qualifies and nothing
changes). Not in any default pipeline: ``SVDQuantW4A4`` over a fused linear smooths and low-rank-approximates the
concatenated weight, which changes its numerics (its one branch of rank ``rank`` x members approximates the
smoothed weight at least as well as the members' own branches, at m times their up-projection cost, and the
smoothing is shared; fp8 / int8 per-row scales are per output row: unchanged), so the user adds the pass
explicitly.

A group: ``aten.linear`` nodes of the top graph reading the same input node, each weight (and bias) a
``get_attr`` that only this linear reads, weights 2-D of one dtype / device and one K, all with a bias (of one
dtype) or all without, of one role class (AdaLN modulation linears only with each other, a mixture of experts'
routers too: the quantizers keep a router in precision, which a fused linear would no longer let them). Skipped,
and counted per reason: unfused LoRA adapters and the base linears they wrap, a weight another node or subgraph
also reads, a weight another pass released (not by this pass), anything whose output width is not its weight's
rows.

Before (one double-stream FLUX block, tp=1)::

    wq = self.transformer_blocks.0.attn.to_q.weight          # [3072, 3072]   (to_k, to_v alike)
    q = aten.linear(norm_x, wq, bq)
    k = aten.linear(norm_x, wk, bk)
    v = aten.linear(norm_x, wv, bv)

After::

    w = self.transformer_blocks.0.attn.to_q.weight            # [9216, 3072]: cat(wq, wk, wv)
    b = self.transformer_blocks.0.attn.to_q.bias              # [9216]
    qkv = aten.linear(norm_x, w, b)
    parts = aten.split_with_sizes(qkv, [3072, 3072, 3072], -1)
    q, k, v = parts[0], parts[1], parts[2]                    # the old outputs' users read these

The fused weight takes the first member's attribute (so a quantizer's module path ``...attn.to_q`` finds it and
its per-output-row tables); the other members' attributes leave the graph. Both go through the weight ledger
(DESIGN.md §14): the user's module keeps meta tensors in their place, and lowering again (another signature)
takes the fused tensor (or the stand-in a later pass's replacement needs) back from the ledger. After tensor
parallelism each member is this rank's shard (sliced rows, or replicated): the concatenation of local shards split
at the local widths gives each shard's output exactly. A model built on the meta device (``weights=``) has each
member read from the checkpoint here. The cache passes (phase ``CACHE``) and ``RegionalCompile`` run later: the
blocks they move into branch subgraphs or outline into templates are already fused (one template per block kind
still), so there is nothing left to fuse inside a subgraph.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import operator

import torch
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..analysis.linear_roles import LINEAR, is_adapter_path
from ..infra.facts import FusedLinear, facts_of
from ..infra.graph_utils import copy_meta, set_val
from ..infra.ownership import is_stand_in
from ..infra.pass_base import Pass, PassContext, PassResult, skipped_summary
from ..infra.phases import Phase
from ..infra.weight_source import read_whole


class FuseSiblingLinears(Pass):
    """Fuse the linears reading one input into one linear over the concatenated weight, then split."""

    name = "fuse_sibling_linears"
    phase = Phase.FUSE_LINEARS
    reads = ("structure",)
    writes = ("fused_linears",)
    invalidates = ("structure",)

    def __init__(self, min_group: int = 2):
        if min_group < 2:
            raise ValueError(f"FuseSiblingLinears(min_group=...) is at least 2, got {min_group}")
        self.min_group = min_group

    def config_items(self) -> Dict[str, Any]:
        return {"min_group": self.min_group}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        structure = get_structure(gm)
        roles = {s.node: s.role for s in structure.linears}
        adapter_owners = {_adapter_owner(s.module_path) for s in structure.linears if s.role == "lora"}
        readers = _attribute_readers(gm)
        skipped: Dict[str, int] = {}
        groups: Dict[Tuple[Any, ...], List[fx.Node]] = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is not LINEAR:
                continue
            why = _why_not(gm, n, roles.get(n, "other"), adapter_owners, readers, ctx, self)
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            w, b = _tensor(gm, n.args[1].target), _bias_node(n)
            key = (n.args[0], w.dtype, w.device, int(w.shape[1]), b is not None,
                   None if b is None else _tensor(gm, b.target).dtype, roles.get(n) == "modulation",
                   roles.get(n) == "router")
            groups.setdefault(key, []).append(n)
        fused, members, widths, fused_paths = 0, 0, [], []
        record: Dict[str, FusedLinear] = {}  # fact fused_linears: the fused linear's path (its first member's)
        for key, nodes in groups.items():
            if len(nodes) < self.min_group:
                continue
            released = {is_stand_in(_tensor(gm, n.args[1].target)) for n in nodes}
            if len(released) > 1:  # lowering again with some members whole: the recorded group no longer holds
                skipped["partly_released"] = skipped.get("partly_released", 0) + len(nodes)
                continue
            fused_paths.append([n.meta.get("dit_module_path", n.name) for n in nodes])
            rows = [int(_tensor(gm, n.args[1].target).shape[0]) for n in nodes]
            record[fused_paths[-1][0]] = FusedLinear(tuple(zip(fused_paths[-1], rows)))
            width = self._fuse(gm, ctx, nodes)
            fused, members = fused + 1, members + len(nodes)
            widths.append(width)
        gm.graph.lint()
        ctx.recompile_at_end(gm)
        if record:
            facts_of(gm).fused_linears = {**facts_of(gm).fused_linears, **record}
        left, left_text = skipped_summary(skipped, "not fused")
        counts = {"fused_groups": fused, "fused_linears": members, "linears_saved": members - fused, **left}
        report = (f"fused {members} linears into {fused} (output widths {sorted(set(widths))})" if fused
                  else "no group of linears reading one input") + left_text
        # compiled.report("fuse_sibling_linears")[graph_id]: what each lowered graph fused and skipped
        ctx.runtime.reports.setdefault(self.name, {})
        ctx.runtime.register_report(self.name, {**ctx.runtime.reports[self.name], ctx.graph_id: {
            "counts": counts, "groups": fused_paths, "report": report}})
        return PassResult(fused > 0, counts, report)

    def _fuse(self, gm: fx.GraphModule, ctx: PassContext, nodes: Sequence[fx.Node]) -> int:
        """Replace ``nodes`` (one group, graph order) by one linear and a split; returns the fused width."""
        ledger = ctx.runtime.weights
        w_targets = [n.args[1].target for n in nodes]
        b_targets = [b.target if b is not None else None for b in map(_bias_node, nodes)]
        rows = [int(_tensor(gm, t).shape[0]) for t in w_targets]
        token = tuple(w_targets)
        starts = [sum(rows[:i]) for i in range(len(rows))]
        span = [f"(rows {s}:{s + r} of {sum(rows)})" for s, r in zip(starts, rows)]
        new_w = self._fused_tensor(gm, ctx, w_targets, token)
        new_b = self._fused_tensor(gm, ctx, b_targets, token) if b_targets[0] is not None else None
        for i, (wt, bt) in enumerate(zip(w_targets, b_targets)):
            for target, new, into in ((wt, new_w, w_targets[0]), (bt, new_b, b_targets[0])):
                if target is None:
                    continue
                how = f"fused into {into} {span[i]}"
                if i == 0:
                    ledger.replace(gm, target, new, by=self, how=how, token=token)
                else:  # its values live on in the first member's attribute (no strong reference kept here:
                    # a later pass replacing the fused tensor must be able to release it)
                    ledger.drop(gm, target, by=self, how=how, replacement=None)
        first = nodes[0]
        g = gm.graph
        with g.inserting_before(first):
            w_node = g.get_attr(w_targets[0])
            b_node = g.get_attr(b_targets[0]) if new_b is not None else None
            lin = g.call_function(LINEAR, (first.args[0], w_node) + ((b_node,) if b_node is not None else ()))
            split = g.call_function(torch.ops.aten.split_with_sizes.default, (lin, rows, -1))
            parts = [g.call_function(operator.getitem, (split, i)) for i in range(len(nodes))]
        for attr_node, t in ((w_node, new_w), (b_node, new_b)):
            if attr_node is not None:
                attr_node.meta["val"] = _fake_like(first.args[1].meta["val"], t)
        for new in (lin, split, *parts):
            copy_meta(new, first)
            set_val(new)
        for old, part in zip(nodes, parts):
            old.replace_all_uses_with(part)
            attrs = [a for a in old.args[1:] if isinstance(a, fx.Node)]
            g.erase_node(old)
            for a in attrs:
                if not a.users:
                    g.erase_node(a)
        return sum(rows)

    def _fused_tensor(self, gm: fx.GraphModule, ctx: PassContext, targets: Sequence[str], token: Any) -> torch.Tensor:
        """cat of the members' tensors along dim 0; lowering again: what the ledger recorded the first time; a
        model built on meta: each member read from the checkpoint."""
        ledger = ctx.runtime.weights
        first = _tensor(gm, targets[0])
        rec = ledger.released(gm, targets[0])
        if rec is not None:
            return ledger.reuse(rec, by=self, token=token, like=first)
        parts = [read_whole(ledger.source, _tensor(gm, t), f"{self.name} (attribute {t})").detach() for t in targets]
        out = torch.cat(parts, 0)
        del parts
        return torch.nn.Parameter(out, requires_grad=False) if isinstance(first, torch.nn.Parameter) else out


def _why_not(gm: fx.GraphModule, n: fx.Node, role: str, adapter_owners, readers: Dict[str, int],
             ctx: PassContext, owner: Pass) -> Optional[str]:
    """Why linear ``n`` cannot join a group (a counted reason), or None."""
    path = n.meta.get("dit_module_path", "")
    if role == "lora" or is_adapter_path(path):
        return "lora_adapter"
    if any(path == o or path.startswith(o + ".") for o in adapter_owners):
        return "lora_base"
    if n.kwargs or len(n.args) < 2:
        return "not_plain"
    attrs = [a for a in n.args[1:] if a is not None]
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in attrs):
        return "weight_not_attribute"
    if any(len(a.users) != 1 or readers.get(a.target, 0) != 1 for a in attrs):
        return "weight_shared"
    w, val = _tensor(gm, attrs[0].target), n.meta.get("val")
    if w.dim() != 2 or not isinstance(val, torch.Tensor) or int(val.shape[-1]) != int(w.shape[0]):
        return "not_plain"
    ledger = ctx.runtime.weights
    for a in attrs:
        if is_stand_in(_tensor(gm, a.target)):
            rec = ledger.released(gm, a.target)
            if rec is None or rec.by != owner.name:
                return "released_by_another_pass"  # its values are gone; the pass that released it rebuilds it
    return None


def _bias_node(n: fx.Node) -> Optional[fx.Node]:
    return n.args[2] if len(n.args) > 2 else None


def _tensor(gm: fx.GraphModule, target: str) -> torch.Tensor:
    return operator.attrgetter(target)(gm)


def _attribute_readers(gm: fx.GraphModule) -> Dict[str, int]:
    """How many get_attr nodes read each attribute of the top graph, over the graph and every subgraph (a
    subgraph's get_attr target is relative to its own module, which shares the top module's tensors: count by
    tensor identity)."""
    by_id: Dict[int, int] = {}
    for mod in gm.modules():
        for x in getattr(getattr(mod, "graph", None), "nodes", ()):
            if x.op == "get_attr":
                key = id(_attr_or_none(mod, x.target))
                by_id[key] = by_id.get(key, 0) + 1
    return {x.target: by_id.get(id(_attr_or_none(gm, x.target)), 0) for x in gm.graph.nodes if x.op == "get_attr"}


def _attr_or_none(mod: torch.nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(mod)
    except AttributeError:
        return None


def _adapter_owner(path: str) -> str:
    """``...attn.to_q.lora_A.default`` -> ``...attn.to_q`` (the module PEFT wrapped)."""
    parts = path.split(".")
    i = next(i for i, p in enumerate(parts) if p.startswith(("lora_", "lokr_", "loha_")))
    return ".".join(parts[:i])


def _fake_like(like: Any, t: torch.Tensor) -> Any:
    """A fake tensor of ``t``'s shape and dtype in ``like``'s fake mode (the graph's)."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    with mode:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)


__all__ = ["FuseSiblingLinears"]
