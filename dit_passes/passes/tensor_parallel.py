"""TensorParallel: Megatron-style tensor parallelism of the transformer blocks, as a graph pass.

Contract: phase ``SHARD_WEIGHTS``; reads fact ``structure`` (linear roles) and invalidates it (head
counts change); writes ``tp_group`` / ``tp_size`` / ``parallel_group``. Needs the export front end
(parameters as ``get_attr``) and a process group of ``size`` ranks; every rank passes the full inputs
and gets the full output; ``size=1`` is a no-op. Rules: :mod:`dit_passes.parallel.tp_sharding`.

Column-parallel linears (``q``/``k``/``v``/``qkv``/``mlp_up``; a fused projection per component) get
their weight rows sliced; the shards are followed through the graph; a linear over a sharded input
becomes row-parallel. Before / after (rank 0 of 2)::

    linear: "f32[1, 16, 64]" = aten.linear(x, to_q.weight, to_q.bias)          # to_q: 64 -> 64
    view: "f32[1, 16, 4, 16]" = aten.view(linear, [1, 16, 4, 16])
    linear_3: "f32[1, 16, 64]" = aten.linear(attn, to_out.weight, to_out.bias)

    linear: "f32[1, 16, 32]" = aten.linear(x, to_q.weight, to_q.bias)          # rows 0..31
    view: "f32[1, 16, 2, 16]" = aten.view(linear, [1, 16, 2, 16])              # local heads
    linear_3 = aten.linear(attn, to_out.weight) -> all_reduce -> wait_tensor -> add(., to_out.bias)

AdaLN modulation linears (about a quarter of FLUX's block weights) are sharded by output rows and their small
output all-gathered (``modulation="column"``, the default: each rank holds 1/size of them; a linear outside the
blocks reading the same weight, as DiT's final norm reads block 0's timestep embedder, is sharded and gathered
alike); ``"replicate"`` keeps them whole on every rank (no all-gather, more memory).
What is sharded, replicated or zero-padded is planned first (:mod:`dit_passes.parallel.tp_plan`): a projection
writing the residual stream stays replicated, so do GQA k / v projections with fewer kv heads than ranks, an
MLP hidden that does not divide by ``size`` is zero-padded where the graph proves the padding exact (counted as
``padded_mlp``), and so are attention heads that do not divide (whole zero heads, zero output-projection columns:
``padded_heads``; both named with their sizes in the report). A weight several linears read alike is sharded once.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, Optional

import torch.distributed as dist
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..parallel.mesh import check_ranks
from ..parallel.tp_plan import divisors, padding_summary, plan_columns
from ..parallel.tp_sharding import TPRules


class TensorParallel(Pass):
    """Shard the blocks' linears over ``size`` ranks of ``group`` (default: the world group)."""

    name = "tensor_parallel"
    phase = Phase.SHARD_WEIGHTS
    reads = ("structure",)
    writes = ("parallel_group", "tp_group", "tp_size")
    invalidates = ("structure",)

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None, modulation: str = "column"):
        check_ranks("TensorParallel(size)", size)
        if modulation not in ("replicate", "column"):
            raise ValueError(f"TensorParallel(modulation=...) is 'replicate' or 'column', got {modulation!r}")
        self.size, self.group, self.modulation = size, group, modulation

    def config_items(self) -> Dict[str, Any]:
        return {"size": self.size, "modulation": self.modulation}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if self.size == 1:
            return PassResult(False, {}, "tensor_parallel size=1: no-op (weights and graph unchanged)")
        adapters = [s.module_path for s in get_structure(gm).linears_with_role("lora")]
        if adapters:
            raise PassError(f"tensor_parallel: {len(adapters)} unfused LoRA adapter projection(s) in the graph (e.g. "
                            f"{adapters[0]}); sharding the base weights would leave the adapters' products "
                            f"unsharded. Fuse them first (pipe.fuse_lora(), or transformer.fuse_lora()), or use "
                            f"context parallelism (Ulysses / Ring), which runs unfused LoRA as is")
        if not (dist.is_available() and dist.is_initialized()):
            raise PassError("tensor_parallel needs an initialised torch.distributed process group: call "
                            "torch.distributed.init_process_group(...) in each of the size processes first")
        group = self.group if self.group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world != self.size:
            raise PassError(f"tensor_parallel: size={self.size} but the process group has {world} ranks; "
                            f"pass size={world} or a group of {self.size} ranks (e.g. ParallelMesh(...).group('tp'))")
        if ctx.frontend != "export":
            raise PassError(f"tensor_parallel shards parameters held as graph attributes, which only the export "
                            f"front end (compile_dit) gives; got frontend={ctx.frontend!r}")
        structure = get_structure(gm)
        _check_heads(structure, self.size)
        plan = plan_columns(structure, self.size)
        rewriter = TPRules(gm, self.size, dist.get_rank(group), group, ctx.runtime.weights, self)
        rewriter.zero = set(plan.zero)
        block_sites = [s for s in structure.linears if s.block is not None]
        tp_sites = structure.column_parallel_linears() + structure.row_parallel_linears()
        before, tp_before = linear_bytes(gm, block_sites), linear_bytes(gm, tp_sites)
        for column in plan.columns:
            rewriter.shard_column(column)
        rewriter.propagate()
        if self.modulation == "column":
            rewriter.shard_modulation([s for s in structure.linears_with_role("modulation") if s.block is not None])
        rewriter.weights.check_readers()
        rewriter.repropagate()
        after, tp_after = linear_bytes(gm, block_sites), linear_bytes(gm, tp_sites)
        facts = facts_of(gm)
        # the cache's decision is agreed over the TP group; a context-parallel pass (a later phase) replaces it
        # with the sequence group, whose ranks hold different tokens
        facts.parallel_group, facts.tp_group, facts.tp_size = group, group, self.size
        row_sites = {s.node for s in structure.row_parallel_linears()}
        off_role = [n.meta.get("dit_module_path", n.name) for n in rewriter.row_nodes if n not in row_sites]
        unsharded_rows = [s.module_path for s in structure.row_parallel_linears() if s.node not in rewriter.row_nodes]
        c = rewriter.counts
        counts = {"column_parallel": c["column"], "row_parallel": len(rewriter.row_nodes),
                  "all_reduce": c["all_reduce"], "norm_all_reduce": c["norm_all_reduce"],
                  "norm_all_gather": c["norm_all_gather"], "replicated_column": len(plan.replicated),
                  "padded_mlp": len(plan.padded) - len(plan.padded_heads), "padded_heads": len(plan.padded_heads),
                  "shared_weights": rewriter.weights.shared(),
                  "all_gather": c["all_gather"], "fallback_all_gather": c["fallback"],
                  "view_rewrites": c["views"], "local_slices": c["slices"],
                  "block_linear_bytes_before": before, "block_linear_bytes_after": after,
                  "qkv_mlp_proj_bytes_before": tp_before, "qkv_mlp_proj_bytes_after": tp_after}
        report = (f"tp={self.size}: {c['column']} column-parallel and {len(rewriter.row_nodes)} row-parallel "
                  f"linears, {c['all_reduce']} all-reduces after row-parallel linears (+{c['norm_all_reduce']} for "
                  f"full-hidden RMSNorms), {c['norm_all_gather']} all-gathers for full-hidden LayerNorms, "
                  f"modulation {self.modulation}; block linear bytes per rank {before} -> {after}")
        if plan.replicated:
            by_reason: Dict[str, list] = {}
            for path, why in plan.replicated.items():
                by_reason.setdefault(why, []).append(path)
            report += "; column-role linears left replicated: " + "; ".join(
                f"{paths} ({why})" for why, paths in by_reason.items())
        mlp = [c for c in plan.padded if not c.head_dim]
        if mlp:
            report += ("; MLP hidden zero-padded to a multiple of tp (zero rows in the up projection, zero columns "
                       "in the down projection): " + padding_summary(mlp))
        if plan.padded_heads:
            report += ("; attention heads zero-padded to whole heads per rank (zero q / k / v rows, zero columns "
                       "in the output projection): " + padding_summary(plan.padded_heads))
        if rewriter.fallback_ops:
            report += f"; all-gathered before unsupported ops: {sorted(set(rewriter.fallback_ops))}"
        if off_role:
            report += f"; row-parallel by dataflow (role not a row role): {off_role}"
        if unsharded_rows:
            report += f"; row-role linears left replicated (input not sharded): {unsharded_rows}"
        return PassResult(True, counts, report)


def linear_bytes(gm: fx.GraphModule, sites) -> int:
    """Bytes of the weights and biases the graph module holds for ``sites`` (LinearSite list)."""
    names = {name for s in sites for name in (s.weight, s.bias) if name is not None}  # each tensor once
    tensors = [functools.reduce(getattr, name.split("."), gm) for name in names]  # parameters or buffers
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_heads(structure, tp: int) -> None:
    """Head counts that do not divide by tp are zero-padded (tp_plan) where q and kv heads are equal; one kv head
    is broadcast over the q heads as it is. Refused: GQA (fewer kv heads than q heads, more than one) where
    either count does not divide, as padded q heads would no longer map to their kv heads."""
    heads = {a.node.name: (int(a.q.meta["val"].shape[1]), int(a.k.meta["val"].shape[1]))
             for a in structure.attention if a.block is not None}
    bad = {k: v for k, v in heads.items() if (v[0] % tp or v[1] % tp) and v[1] not in (1, v[0])}
    if bad:
        g = math.gcd(*[h for v in heads.values() for h in v if h != 1] or [1])
        raise PassError(f"tensor_parallel size={tp}: attention head counts (q, kv) {sorted(set(bad.values()))} "
                        f"are not divisible by {tp} (e.g. at {next(iter(bad))}), and with fewer kv heads than q "
                        f"heads (GQA) padding them to whole heads per rank would break the q-to-kv head mapping; "
                        f"valid sizes: {divisors(g)}")
