"""TensorParallel: Megatron-style tensor parallelism of the transformer blocks, as a graph pass.

Contract
  phase ``SHARD_WEIGHTS`` (before anything replaces the aten linears and attention it reads).
  reads: fact ``structure`` (block discovery's linear roles); parameters as ``get_attr`` attributes
  (the ``compile_dit`` / export front end); an initialised process group whose size is ``size``.
  writes: facts ``tp_group`` / ``tp_size`` and ``parallel_group`` (context parallelism, a later phase,
  replaces the latter). invalidates ``structure``
  (head counts change).
  guarantees: every rank passes the full inputs and gets the full (replicated) output.

What is sharded how (from roles only, no per-model tables):
* column-parallel (``q``/``k``/``v``/``qkv``/``mlp_up`` in blocks): weight rows and bias sliced at pass
  time; a fused projection (QKV, gated MLP, Flux2's QKV+MLP) is sliced per component, the components
  being the pieces the graph splits its output into (``tp_sharding.output_segments``).
* the sharded values are then followed through the graph (views, permutes, pointwise ops, RoPE, cat,
  split, attention over the local heads): reshape/view/unflatten/expand size arguments that carried the
  head count or the hidden size are rewritten (heads -> heads/tp, hidden -> hidden/tp).
* row-parallel: every linear that consumes a value sharded along its input features (``attn_out``,
  ``mlp_down``, Flux single blocks' ``proj`` over concat(attention, MLP), sliced consistently with both
  pieces): weight columns sliced, ``linear(x, w_shard)`` + one all-reduce (sum) + the *full* bias added
  after the reduction (exact: the bias is added once, never divided).
* per-head norms (RMSNorm over head_dim) stay local; an RMSNorm over the sharded hidden size (Wan's
  norm_q/norm_k over all heads) becomes a distributed RMSNorm: local sum of squares, one all-reduce of a
  (B, S, 1) tensor, division by the full size. A LayerNorm/GroupNorm over the sharded dim is refused.
* replicated tensors meeting a sharded one at full size (a full-width scale, a per-head mask) are sliced
  to the local part; an op the pass does not know gets its sharded inputs all-gathered (correct, slow;
  counted as ``fallback_all_gather`` and named in the report).
* AdaLN modulation linears: replicated by default (``modulation="column"``: rows sharded, output
  all-gathered). The modulation input is one (B, C) vector per sample, so its linear is cheap next to the
  per-token ones while an all-gather costs a latency per call; see tests / report for the measurement.

size=1 is a documented no-op (nothing changes, no process group is needed).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..parallel.tp_sharding import (GraphSharder, ShardingError, ShardSpec, check_divisible, linear_bytes,
                                    map_view_dim, split_dim, split_sizes)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unflatten.int,
          aten.flatten.using_ints, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.squeeze.default}
# ops whose output has the shape of argument 0 and whose other tensor arguments are not broadcast operands
_LIKE_ARG0 = {aten.dropout.default, aten.type_as.default, aten._to_copy.default, aten.to.dtype,
              aten.contiguous.default, aten.empty_like.default, aten.zeros_like.default,
              aten.ones_like.default, aten.full_like.default, aten.alias.default, aten.detach.default,
              aten.clone.default}
_NORMS_REFUSED = {aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default}
# reductions over a list of dims (arg 1) with keepdim (arg 2) -> the collective that completes them
_REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "sum", aten.amax.default: "max",
               aten.amin.default: "min"}


class TensorParallel(Pass):
    """Shard the blocks' linears over ``size`` ranks of ``group`` (default: the world group)."""

    name = "tensor_parallel"
    phase = Phase.SHARD_WEIGHTS
    reads = ("structure",)
    writes = ("parallel_group", "tp_group", "tp_size")
    invalidates = ("structure",)

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None, modulation: str = "replicate"):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"TensorParallel(size=...) needs a positive int, got {size!r}")
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
        rewriter = _Rewriter(gm, self.size, dist.get_rank(group), group)
        block_sites = [s for s in structure.linears if s.block is not None]
        tp_sites = structure.column_parallel_linears() + structure.row_parallel_linears()
        before, tp_before = linear_bytes(gm, block_sites), linear_bytes(gm, tp_sites)
        for site in structure.column_parallel_linears():
            rewriter.shard_column(site)
        rewriter.propagate()
        if self.modulation == "column":
            for site in structure.linears_with_role("modulation"):
                if site.block is not None:
                    rewriter.shard_modulation(site)
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
                  "all_gather": c["all_gather"], "fallback_all_gather": c["fallback"],
                  "view_rewrites": c["views"], "local_slices": c["slices"],
                  "block_linear_bytes_before": before, "block_linear_bytes_after": after,
                  "qkv_mlp_proj_bytes_before": tp_before, "qkv_mlp_proj_bytes_after": tp_after}
        report = (f"tp={self.size}: {c['column']} column-parallel and {len(rewriter.row_nodes)} row-parallel "
                  f"linears, {c['all_reduce']} all-reduces after row-parallel linears (+{c['norm_all_reduce']} for "
                  f"full-hidden RMSNorms), modulation {self.modulation}; block linear bytes per rank "
                  f"{before} -> {after}")
        if rewriter.fallback_ops:
            report += f"; all-gathered before unsupported ops: {sorted(set(rewriter.fallback_ops))}"
        if off_role:
            report += f"; row-parallel by dataflow (role not a row role): {off_role}"
        if unsharded_rows:
            report += f"; row-role linears left replicated (input not sharded): {unsharded_rows}"
        return PassResult(True, counts, report)


def _divisors(n: int) -> List[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


def _check_heads(structure, tp: int) -> None:
    heads = {}
    for a in structure.attention:
        if a.block is None:
            continue
        heads[a.node.name] = (int(a.q.meta["val"].shape[1]), int(a.k.meta["val"].shape[1]))
    bad = {k: v for k, v in heads.items() if v[0] % tp or v[1] % tp}
    if bad:
        g = math.gcd(*[h for v in heads.values() for h in v])
        raise PassError(f"tensor_parallel size={tp}: attention head counts (q, kv) {sorted(set(bad.values()))} "
                        f"are not divisible by {tp} (e.g. at {next(iter(bad))}); valid sizes: {_divisors(g)}")


class _Rewriter(GraphSharder):
    """The propagation rules: the shard spec of every value reached from a column-parallel output."""

    def _s(self, a) -> Optional[ShardSpec]:
        s = self.spec.get(a) if isinstance(a, fx.Node) else None
        return s if isinstance(s, ShardSpec) else None

    def propagate(self) -> None:
        for n in list(self.g.nodes):
            if n in self.inserted:
                continue
            if n.op == "output":
                self._fallback(n, "graph output")
                continue
            if n.op != "call_function" or not any(a in self.spec for a in n.all_input_nodes):
                continue
            try:
                self._rule(n)
            except ShardingError as e:
                raise PassError(f"tensor_parallel: cannot shard node {n.name} ({n.target}) at "
                                f"{n.meta.get('dit_module_path', '?')}: {e}") from None

    def _fallback(self, n: fx.Node, what: str) -> None:
        for a in list(n.all_input_nodes):
            s = self._s(a)
            if s is not None:
                n.replace_input_with(a, self._gather(a, s, n))
                self.counts["fallback"] += 1
                self.fallback_ops.append(what)

    def _rule(self, n: fx.Node) -> None:  # noqa: C901 - one dispatch over op kinds
        t, args = n.target, n.args
        x = args[0] if args else None
        sx = self._s(x)
        val = n.meta["val"]
        if t is operator.getitem:
            src = self.spec.get(x)
            if isinstance(src, list) and src[args[1]] is not None:
                self.spec[n] = src[args[1]]
            return
        if t is aten.linear.default:
            return self._linear(n, sx)
        if t in _VIEWS and sx is not None:
            return self._view(n, sx)
        if t in (aten.view_as_complex.default, aten.view_as_real.default) and sx is not None:
            if sx.dim >= x.meta["val"].dim() - (t is aten.view_as_complex.default):
                raise ShardingError("complex view of the sharded last dim")
            self.spec[n] = sx  # only the trailing (real, imag) dim changes
            return
        if t is aten.permute.default and sx is not None:
            perm = [p % val.dim() for p in args[1]]
            self.spec[n] = sx.with_dim(perm.index(sx.dim))
            return
        if t is aten.transpose.int and sx is not None:
            a, b = (int(v) % val.dim() for v in args[1:3])
            self.spec[n] = sx.with_dim(b if sx.dim == a else a if sx.dim == b else sx.dim)
            return
        if t is aten.expand.default and sx is not None:
            od = sx.dim + val.dim() - x.meta["val"].dim()
            sizes = list(args[1])
            if sizes[od] != -1:
                sizes[od] = sx.local(self.tp)
                n.args = (x, sizes) + tuple(args[2:])
                self.counts["views"] += 1
            self.spec[n] = sx.with_dim(od)
            return
        if t is aten.type_as.default and sx is None:
            return  # a replicated value cast to a sharded one's dtype: argument 1 gives only the dtype
        if t in _LIKE_ARG0 and sx is not None:
            self.spec[n] = sx
            return
        if t is aten.slice.Tensor and sx is not None:
            dim = int(args[1]) % val.dim()
            if dim == sx.dim:
                raise ShardingError("slicing along the sharded dim")
            self.spec[n] = sx
            return
        if t is aten.select.int and sx is not None:
            dim = int(args[1]) % x.meta["val"].dim()
            if dim == sx.dim:
                raise ShardingError("selecting along the sharded dim")
            self.spec[n] = sx.with_dim(sx.dim - (dim < sx.dim))
            return
        if split_sizes(n, 1) is not None and sx is not None:
            return self._split(n, sx)
        if t is aten.unbind.int and sx is not None:
            dim = int(args[1] if len(args) > 1 else 0) % x.meta["val"].dim()
            if dim == sx.dim:
                raise ShardingError("unbind along the sharded dim")
            self.spec[n] = [sx.with_dim(sx.dim - (dim < sx.dim))] * len(val)
            return
        if t in (aten.cat.default, aten.stack.default):
            return self._cat(n)
        if t is aten.scaled_dot_product_attention.default:
            return self._sdpa(n)
        if t is aten.rms_norm.default and sx is not None:
            return self._rms_norm(n, sx)
        if t in _NORMS_REFUSED and sx is not None:
            nd = len(args[1]) if t is not aten.group_norm.default else val.dim()
            if sx.dim >= val.dim() - nd:
                raise ShardingError(f"{t} normalises over the sharded hidden size; only RMSNorm over a sharded "
                                    "dim is supported (run without TensorParallel for this model)")
            self.spec[n] = sx if t is not aten.native_layer_norm.default else [sx, None, None]
            return
        if t in _REDUCTIONS and sx is not None:
            return self._reduction(n, sx)
        if t in (aten.copy_.default, aten.copy.default):
            return self._pointwise(n, [0, 1])
        if t is aten.slice_scatter.default:
            dim = int(args[2] if len(args) > 2 else n.kwargs.get("dim", 0)) % val.dim()
            ref = sx or self._s(args[1])
            if dim == ref.dim:
                raise ShardingError("slice_scatter along the sharded dim")
            return self._pointwise(n, [0, 1])
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(n, range(len(args)))
        self._fallback(n, str(t))

    def _linear(self, n: fx.Node, sx: Optional[ShardSpec]) -> None:
        x, w = n.args[0], n.args[1]
        if sx is None:
            return self._fallback(n, "linear weight/bias from a sharded value")
        if sx.dim != x.meta["val"].dim() - 1:
            self.spec[n] = sx  # linear over another dim: the shard passes through
            return
        if any(self._s(a) is not None for a in n.args[1:]):
            return self._fallback(n, "linear weight from a sharded value")
        in_features = int(w.meta["val"].shape[1])
        if sx.full != in_features:
            raise ShardingError(f"input sharded over {sx.full} features, the weight has {in_features}")
        self._replace_param(w, 1, sx.segments, [n])
        bias = n.args[2] if len(n.args) > 2 else None
        with self.g.inserting_before(n.next):  # (inserting_after would stack new nodes in reverse order)
            local = self._call(aten.linear.default, (x, w), like=n)
            out = self._all_reduce(local, n)
            if bias is not None:
                out = self._call(aten.add.Tensor, (out, bias), like=n)  # full bias, once, after the sum
        out.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
        n.replace_all_uses_with(out)
        self.g.erase_node(n)
        self.row_nodes.append(n)  # the original node: compared with the structure's row-parallel sites
        self.counts["all_reduce"] += 1

    def _view(self, n: fx.Node, sx: ShardSpec) -> None:
        x, t = n.args[0], n.target
        in_shape, out_shape = list(x.meta["val"].shape), list(n.meta["val"].shape)
        k = map_view_dim(in_shape, out_shape, sx.dim, self.tp)
        if len(sx.segments) > 1 and in_shape[sx.dim] != out_shape[k]:
            raise ShardingError(f"a view that splits or merges a dim made of {len(sx.segments)} sharded "
                                f"segments {list(sx.segments)}")
        local = out_shape[k] // self.tp
        if t in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            shape = list(n.args[1])
            if shape[k] != -1:
                shape[k] = local
                n.args = (x, shape)
                self.counts["views"] += 1
        elif t is aten.unflatten.int:
            d = int(n.args[1]) % len(in_shape)
            sizes = list(n.args[2])
            if d <= k < d + len(sizes) and sizes[k - d] != -1:
                sizes[k - d] = local
                n.args = (x, n.args[1], sizes)
                self.counts["views"] += 1
        segs = sx.segments if len(sx.segments) > 1 else (out_shape[k],)
        self.spec[n] = ShardSpec(k, segs)

    def _split(self, n: fx.Node, sx: ShardSpec) -> None:
        x = n.args[0]
        dim = split_dim(n)
        full = int(x.meta["val"].shape[dim])
        sizes = split_sizes(n, full)
        if dim != sx.dim:
            self.spec[n] = [sx] * len(sizes)
            return
        # each piece must be a run of whole segments
        pieces, segs, acc, cur = [], list(sx.segments), 0, []
        for size in sizes:
            while acc < size and segs:
                cur.append(segs.pop(0))
                acc += cur[-1]
            if acc != size:
                raise ShardingError(f"split sizes {list(sizes)} cut through the sharded segments {list(sx.segments)}")
            pieces.append(ShardSpec(dim, tuple(cur)))
            acc, cur = 0, []
        local = [p.local(self.tp) for p in pieces]
        if n.target is aten.chunk.default:
            if len(set(local)) != 1:
                raise ShardingError(f"chunk into unequal local pieces {local}")
        else:
            n.args = (x, local if n.target is not aten.split.Tensor or len(set(local)) > 1 else local[0]) + tuple(n.args[2:])
            self.counts["views"] += 1
        self.spec[n] = pieces

    def _cat(self, n: fx.Node) -> None:
        tensors = list(n.args[0])
        dim = int(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        ref = next(self._s(a) for a in tensors if self._s(a) is not None)
        nd = tensors[0].meta["val"].dim()
        dim %= nd + (n.target is aten.stack.default)
        if n.target is aten.cat.default and dim == ref.dim:
            segs, new = [], []
            for a in tensors:
                s = self._s(a)
                if s is None:  # a replicated piece becomes one more sharded segment
                    s = ShardSpec(dim, (int(a.meta["val"].shape[dim]),))
                    check_divisible(s.segments, self.tp, f"replicated input {a.name} of a cat along the shard")
                    a = self._local(a, dim, s, n)
                segs.extend(s.segments)
                new.append(a)
            n.args = (new,) + tuple(n.args[1:])
            self.spec[n] = ShardSpec(dim, tuple(segs))
            return
        new = []
        for a in tensors:
            s = self._s(a)
            if s is None:
                a = self._local(a, ref.dim, ref, n)
            elif s != ref:
                raise ShardingError(f"cat/stack of values sharded differently: {s} vs {ref}")
            new.append(a)
        n.args = (new,) + tuple(n.args[1:])
        out_dim = ref.dim + (n.target is aten.stack.default and dim <= ref.dim)
        self.spec[n] = ref.with_dim(out_dim)

    def _sdpa(self, n: fx.Node) -> None:
        q, k, v = n.args[:3]
        specs = [self._s(a) for a in (q, k, v)]
        if any(s is not None and s.dim != 1 for s in specs):
            raise ShardingError(f"attention needs q, k, v sharded over heads (dim 1), got {specs}")
        for a, s in zip((q, k, v), specs):
            if s is None:  # a replicated q/k/v (computed outside the sharded linears): take the local heads
                heads = int(a.meta["val"].shape[1])
                check_divisible([heads], self.tp, f"attention input {a.name}")
                n.replace_input_with(a, self._local(a, 1, ShardSpec(1, (heads,)), n))
        specs = [s or ShardSpec(1, (int(a.meta["val"].shape[1]),)) for a, s in zip((q, k, v), specs)]
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            mv = mask.meta["val"]
            hd = mv.dim() - 3
            if self._s(mask) is None and hd >= 0 and int(mv.shape[hd]) > 1:
                local = self._local(mask, hd, ShardSpec(hd, (int(mv.shape[hd]),)), n)
                n.replace_input_with(mask, local)
        self.spec[n] = specs[0]

    def _rms_norm(self, n: fx.Node, sx: ShardSpec) -> None:
        x, shape = n.args[0], list(n.args[1])
        weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        eps = n.args[3] if len(n.args) > 3 else n.kwargs.get("eps")
        xv = x.meta["val"]
        first = xv.dim() - len(shape)
        if sx.dim < first:  # per-head norm: the sharded dim is not normalised over
            self.spec[n] = sx
            return
        # Distributed RMSNorm (the norm covers the sharded hidden): sum of squares over the local part,
        # one all-reduce, division by the full count; same op order as aten.rms_norm.
        count = 1
        for s in shape:
            count *= int(s)
        eps = torch.finfo(torch.float32 if xv.dtype in (torch.float16, torch.bfloat16) else xv.dtype).eps \
            if eps is None else eps
        dims = list(range(first, xv.dim()))
        with self.g.inserting_before(n):
            xf = x if xv.dtype not in (torch.float16, torch.bfloat16) else \
                self._call(aten._to_copy.default, (x,), {"dtype": torch.float32}, like=n)
            sq = self._call(aten.pow.Tensor_Scalar, (xf, 2), like=n)
            ss = self._call(aten.sum.dim_IntList, (sq, dims, True), like=n)
            ss = self._all_reduce(ss, n)
            ms = self._call(aten.div.Tensor, (ss, count), like=n)
            r = self._call(aten.rsqrt.default, (self._call(aten.add.Tensor, (ms, eps), like=n),), like=n)
            y = self._call(aten.mul.Tensor, (xf, r), like=n)
            y = self._call(aten.type_as.default, (y, x), like=n)
            if weight is not None:
                wd = sx.dim - first
                wl = self._local(weight, wd, ShardSpec(wd, sx.segments), n)
                y = self._call(aten.mul.Tensor, (y, wl), like=n)
        y.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
        n.replace_all_uses_with(y)
        self.g.erase_node(n)
        self.spec[y] = sx
        self.counts["norm_all_reduce"] += 1

    def _reduction(self, n: fx.Node, sx: ShardSpec) -> None:
        """Reduction over some dims: local if the sharded dim is kept, else completed by an all-reduce
        (a decomposed RMSNorm over the full hidden: mean of squares = sum of the ranks' means / tp)."""
        x = n.args[0]
        nd = x.meta["val"].dim()
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        dims = list(range(nd)) if dims is None or dims == [] else [int(d) % nd for d in dims]
        keep = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        if sx.dim not in dims:
            self.spec[n] = sx.with_dim(sx.dim if keep else sx.dim - sum(d < sx.dim for d in dims))
            return
        users = list(n.users)
        with self.g.inserting_before(n.next):
            r = self._call(c10d.all_reduce.default, (n, _REDUCTIONS[n.target], self.group_name), like=n)
            out = self._call(c10d.wait_tensor.default, (r,), like=n)
            if n.target is aten.mean.dim:
                out = self._call(aten.div.Tensor, (out, self.tp), like=n)
        out.meta["val"] = n.meta["val"]
        for u in users:
            u.replace_input_with(n, out)
        self.inserted.add(n)  # recompute its (local) shape
        self.counts["norm_all_reduce"] += 1

    def _pointwise(self, n: fx.Node, positions) -> None:
        """Broadcasting op: sharded inputs must agree; replicated full-size operands are sliced."""
        nd = n.meta["val"].dim()
        ref = None
        for i in positions:
            a = n.args[i]
            s = self._s(a)
            if s is not None:
                od = s.dim + nd - a.meta["val"].dim()
                if ref is not None and ref != s.with_dim(od):
                    raise ShardingError(f"operands sharded differently: {ref} vs {s.with_dim(od)}")
                ref = s.with_dim(od)
        if ref is None:
            return self._fallback(n, f"{n.target} with a sharded non-tensor-position input")
        new = list(n.args)
        for i in positions:
            a = new[i]
            if not isinstance(a, fx.Node) or self._s(a) is not None or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            av = a.meta["val"]
            d = ref.dim - (nd - av.dim())
            if d >= 0 and int(av.shape[d]) != 1:
                if n.target is aten.copy_.default and i == 0:  # would write a shard into a full tensor
                    raise ShardingError("in-place copy of a sharded value into a replicated tensor")
                new[i] = self._local(a, d, ref.with_dim(d), n)
        n.args = tuple(new)
        self.spec[n] = ref

    # -- shapes ----------------------------------------------------------------------------------
