"""VAE-P rule table: exact spatial (row) parallelism of a diffusers VAE graph over the shared driver.

The graph is captured on this rank's slab of rows (and, for checking, on the full input); the rewrite
makes it take the full input and compute exactly the single-process result. Specific to row slabs
(the shared rules do the rest, :mod:`~dit_passes.parallel.propagate`, :meth:`VAERules.local`):
entry slice; a conv taller than one row gets a ``vae_halo_exchange`` and no height padding (a zero
pad before it folds in); a group norm gets global statistics (``vae_group_stats`` -> all_reduce ->
``vae_group_norm_apply``); attention all-gathers keys and values; the output is all-gathered. Every
node's split is checked against the reference shapes; an op that would mix rows is refused by name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..infra.graph_utils import set_val
from ..infra.pass_base import PassError
from . import op_classes as oc
from . import vae_ops
from .propagate import Placement, Propagation, Touches, agree, aligned_dim, moved_dim, val as _val, view_dims

__all__ = ["VAEShardingError", "shard_vae_graph", "split_rows"]
split_rows = vae_ops.split_rows

aten = oc.aten
_vae_ops = torch.ops.dit_passes


@dataclasses.dataclass(frozen=True)
class Shard(Placement):
    """Which dim of a value is split over the ranks, and every rank's extent along it."""
    dim: int
    sizes: Tuple[int, ...]


class VAEShardingError(PassError, NotImplementedError):
    """An op VAE-P cannot run on row slabs (a PassError for the pass manager, NotImplementedError as before)."""


def _spatial(v: Any, default: int, n: int) -> List[int]:
    """A conv's stride / padding / dilation argument as one int per spatial dim."""
    v = [default] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]
    return [int(i) for i in (v * n if len(v) == 1 else v)]


class VAERules(Propagation):
    """Rewrites a graph captured on this rank's slab into the sharded, exact graph (see module doc)."""

    def __init__(self, gm: fx.GraphModule, rows: Sequence[int], rank: int, group_name: str,
                 reference: Optional[Dict[str, Tuple[int, ...]]] = None):
        super().__init__(gm, group_name, len(rows), rank)
        self.ref, self.rows, self.sh = reference or {}, tuple(rows), self.place  # sh: row-split values
        self.hpad: Dict[fx.Node, Tuple[int, int]] = {}      # pads whose height part a conv must absorb
        self.replaced: Dict[fx.Node, fx.Node] = {}
        self.vals_now = True  # each rule checks the local shapes of what it emitted

    def error(self, node: fx.Node, why: str) -> VAEShardingError:
        where = node.meta.get("dit_module_path", "?")
        return VAEShardingError(f"VAE-P cannot shard `{node.format_node()}` (module {where!r}): {why}")

    # --- entry / exit -------------------------------------------------------------------------------
    def run(self) -> Dict[str, int]:
        placeholders = [n for n in self.g.nodes if n.op == "placeholder"]
        ph = placeholders[0]
        local = _val(ph)
        if len(placeholders) != 1 or local.dim() not in (4, 5):
            raise VAEShardingError(f"VAE-P splits one (N, C, [T,] H, W) input, the graph takes "
                                      f"{[tuple(_val(p).shape) for p in placeholders]}")
        start, hd = sum(self.rows[:self.rank]), local.dim() - 2
        with self.g.inserting_after(ph):
            entry = self.g.call_function(aten.slice.Tensor, (ph, hd, start, start + self.rows[self.rank]))
        ph.replace_all_uses_with(entry, delete_user_cb=lambda user: user is not entry)
        shape = list(local.shape)
        shape[hd] = sum(self.rows)
        with local.fake_mode:
            ph.meta["val"] = local.new_empty(shape)
        set_val(entry)
        self.sh[entry] = Shard(hd, self.rows)
        self.inserted.add(entry)
        self.walk(list(self.g.nodes), self.visit)
        out = self.g.output_node()
        with self.g.inserting_before(out):
            out.args = (tuple(self.gather(o, self.sh[o]) if o in self.sh else o for o in out.args[0]),)
        self.g.eliminate_dead_code()
        self.g.lint()
        self.gm.recompile()
        return dict(self.counts)

    def gather(self, x: fx.Node, s: Shard) -> fx.Node:
        """All-gather ``x`` along ``s.dim`` (one collective; uneven extents padded then trimmed)."""
        self.counts["all_gather"] += 1
        return self.all_gather(x, s.dim, s.sizes, like=x)

    # --- per node ----------------------------------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        """Rewrite / annotate one node, then check its sharding against the single-process graph: the
        local shape with the sharded dim widened to the total must be the reference shape."""
        name = node.name
        self._visit(node)
        node = self.replaced.get(node, node)
        s, ref = self.sh.get(node), self.ref.get(name)
        if s is not None and ref is not None and node not in self.hpad and isinstance(_val(node), torch.Tensor):
            shape = list(_val(node).shape)
            shape[s.dim] = sum(s.sizes)
            if tuple(shape) != tuple(ref):
                raise self.error(node, f"internal: sharded {s} gives {shape}, the single-process graph has {list(ref)}")

    def _visit(self, node: fx.Node) -> None:
        ins = [a for a in node.all_input_nodes if a in self.sh]
        t = node.target
        if any(a in self.hpad for a in node.all_input_nodes) and t not in oc.CONVS:
            raise self.error(node, "it consumes a height padding that only a following convolution can absorb")
        if not ins or t is aten._assert_tensor_metadata.default:
            return
        if t in oc.CONVS:
            return self.conv(node)
        if t is aten.group_norm.default:
            return self.group_norm(node)
        if t is oc.SDPA:
            return self.attention(node)
        if t in oc.PADS:
            return self.pad(node)
        s = self.local(node)
        if s is not None:
            self.sh[node] = s

    def local(self, node: fx.Node) -> Optional[Shard]:
        """The split of the output of an op that runs unchanged on each rank's slab (None: not split);
        refuses an op that would need rows of other ranks."""
        t, args, sh = node.target, node.args, self.sh
        if t is aten.type_as.default:  # the other tensor only lends its dtype
            return sh.get(args[0])
        s, x = next(sh[a] for a in node.all_input_nodes if a in sh), args[0]
        if t in oc.LIKE_ARG0 or t in oc.EXPANDS or oc.is_pointwise(t):
            tensors = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
            shard = agree(node, sh.get, tensors, lambda why: self.error(node, why))
            for a in tensors:
                if a not in sh and aligned_dim(node, a, shard.dim) is not None:
                    raise self.error(node, f"`{a.name}` is replicated but not broadcast along the split dim")
            return shard
        if t in oc.SIZE_VIEWS:
            return self.view(node, s)
        if t is oc.GETITEM:
            return s
        if t in (aten.cat.default, aten.stack.default):
            d = (int(args[1]) if len(args) > 1 else 0) % _val(node).dim()
            if any(sh.get(a) != s for a in args[0]) or (t is aten.cat.default and d == s.dim):
                raise self.error(node, "cat along the split dim, or of split with unsplit tensors")
            return Shard(s.dim + (1 if t is aten.stack.default and d <= s.dim else 0), s.sizes)
        if t in oc.NEAREST_UPSAMPLES:
            h_in, h_out = _val(x).shape[s.dim], _val(node).shape[s.dim]
            scales = args[2] if len(args) > 2 else None
            if s.dim != _val(x).dim() - 2 or h_out % h_in or (scales and float(scales[0]) != h_out // h_in):
                raise self.error(node, "nearest upsampling along height is local only by an integer factor")
            return Shard(s.dim, tuple(n * (h_out // h_in) for n in s.sizes))
        if x in sh:
            try:
                return s.with_dim(moved_dim(node, s.dim))
            except Touches as why:
                if t is aten.slice.Tensor and _val(node).shape[s.dim] == _val(x).shape[s.dim]:
                    return s  # a slice that keeps the whole split dim
                raise self.error(node, str(why).replace("sharded", "split"))
            except KeyError:
                pass
        raise self.error(node, "an op this rewrite does not know to act locally on the split dim")

    def view(self, node: fx.Node, s: Shard) -> Shard:
        # the rank slabs stay slabs of an output dim (propagate.view_dims); size-1 dims make it ambiguous
        # where this rank has one row: the single-process shape decides
        src, dst, ref = list(_val(node.args[0]).shape), list(_val(node).shape), self.ref.get(node.name)
        for e, cuts in view_dims(src, dst, s.dim, [sum(s.sizes[:j]) for j in range(len(s.sizes) + 1)]):
            sizes = tuple(b - a for a, b in zip(cuts, cuts[1:]))
            if sizes[self.rank] == dst[e] and (ref is None or list(ref) == dst[:e] + [sum(sizes)] + dst[e + 1:]):
                return Shard(e, sizes)
        raise self.error(node, f"a view {src} -> {dst} that does not keep the rank slabs of dim {s.dim} whole")

    def pad(self, node: fx.Node) -> None:
        x, pads = node.args[0], [int(p) for p in node.args[1]]
        s, ndim = self.sh[x], _val(x).dim()
        rest = list(node.args[2:]) if node.target is aten.pad.default else ["constant"] + list(node.args[2:])
        mode, value = (rest + ["constant", 0.0][len(rest):])[:2]
        pos = ndim - 1 - s.dim
        hp = (pads[2 * pos], pads[2 * pos + 1]) if 2 * pos + 1 < len(pads) else (0, 0)
        self.sh[node] = s
        if hp == (0, 0):
            return
        if mode != "constant" or (value or 0.0) != 0.0 or min(hp) < 0:
            raise self.error(node, "only zero padding along the sharded height can be folded into a halo")
        pads[2 * pos] = pads[2 * pos + 1] = 0
        node.args = (x, pads) + tuple(node.args[2:])
        set_val(node)
        self.hpad[node] = hp

    # --- the three distributed rewrites -------------------------------------------------------------
    def conv(self, node: fx.Node) -> None:
        x, w, bias, stride, padding, dilation, groups = list(node.args) + [None] * (7 - len(node.args))
        s, nd = self.sh[x], _val(x).dim()
        if s.dim != nd - 2:
            raise self.error(node, "a convolution split along a dim other than height")
        (stride, padding, dilation), kh = (_spatial(v, d, nd - 2) for v, d in
                                           ((stride, 1), (padding, 0), (dilation, 1))), _val(w).shape[-2]
        top, bottom = self.hpad.get(x, (0, 0))
        sh, p_top, p_bot, k = stride[-2], padding[-2] + top, padding[-2] + bottom, dilation[-2] * (kh - 1) + 1
        # rank j's rows [R_j, R_j+1) give output rows from R_j / sh: it needs p_top rows above (from rank
        # j-1, or zeros at the top) and k - sh - p_top below (from rank j+1, or p_bot zeros at the bottom)
        before, after = p_top, k - sh - p_top
        if after < 0:
            raise self.error(node, f"kernel {kh} with stride {sh} skips rows between ranks")
        starts = [sum(s.sizes[:j]) for j in range(self.world)]
        outs = []
        for j, n in enumerate(s.sizes):
            b, a = vae_ops.halo_rows(j, self.world, before, after, p_top, p_bot)
            if (j > 0 and before > s.sizes[j - 1]) or (j < self.world - 1 and after > s.sizes[j + 1]):
                raise self.error(node, f"rank extents {list(s.sizes)} are smaller than the halo ({before}, {after})")
            if starts[j] % sh:
                raise self.error(node, f"rank {j} starts at row {starts[j]}, not a multiple of the stride {sh}")
            outs.append((n + a + b - k) // sh + 1)
        total = (sum(s.sizes) + p_top + p_bot - k) // sh + 1
        if sum(outs) != total or any(outs[j] * sh != s.sizes[j] for j in range(self.world - 1)):
            raise self.error(node, f"the slabs {list(s.sizes)} do not map onto whole output rows")
        old_shape = tuple(_val(node).shape)
        if before or after or p_top or p_bot:
            with self.g.inserting_before(node):
                x = self.emit(_vae_ops.vae_halo_exchange.default,
                              (x, s.dim, before, after, p_top, p_bot, self.group), like=node)
            self.counts["halo_exchange"] += 1
        padding[-2] = 0
        node.args = (x, w, bias, stride, padding, dilation, 1 if groups is None else groups)
        set_val(node)
        if tuple(_val(node).shape) != old_shape or old_shape[s.dim] != outs[self.rank]:
            raise self.error(node, f"internal: halo conv gives {tuple(_val(node).shape)}, captured {old_shape}")
        self.sh[node] = Shard(s.dim, tuple(outs))

    def group_norm(self, node: fx.Node) -> None:
        x, groups = node.args[0], int(node.args[1])
        weight = node.args[2] if len(node.args) > 2 else None
        bias = node.args[3] if len(node.args) > 3 else None
        eps = float(node.args[4]) if len(node.args) > 4 else 1e-5
        if self.sh[x].dim < 2:
            raise self.error(node, "group norm sharded along batch or channels")
        with self.g.inserting_before(node):
            st = self.emit(_vae_ops.vae_group_stats.default, (x, groups), like=node)
            st = self.all_reduce(st, node)
            out = self.emit(_vae_ops.vae_group_norm_apply.default, (x, st, groups, weight, bias, eps), like=node)
        node.replace_all_uses_with(out)
        self.g.erase_node(node)
        self.replaced[node] = out
        self.sh[out] = self.sh[x]
        self.counts["all_reduce"] += 1

    def attention(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        tok = _val(q).dim() - 2
        shards = [self.sh.get(a) for a in (q, k, v)]
        if mask is not None or causal or any(s is None or s.dim != tok for s in shards) or len(set(shards)) != 1:
            raise self.error(node, "attention needs q, k, v sharded along tokens, no mask, not causal")
        dk, dv = _val(k).shape[-1], _val(v).shape[-1]
        if tuple(_val(k).shape[:-1]) != tuple(_val(v).shape[:-1]):
            raise self.error(node, "keys and values of different shapes")
        with self.g.inserting_before(node):
            kv = self.emit(aten.cat.default, ([k, v], -1), like=node)
            kv = self.gather(kv, Shard(tok, shards[0].sizes))
            kf = self.emit(aten.slice.Tensor, (kv, -1, 0, dk), like=node)
            vf = self.emit(aten.slice.Tensor, (kv, -1, dk, dk + dv), like=node)
        node.args = (q, kf, vf) + tuple(node.args[3:])
        self.sh[node] = shards[0]
        self.counts["attention_gathered"] += 1


def shard_vae_graph(gm: fx.GraphModule, rows: Sequence[int], rank: int, group_name: str,
                    reference: Optional[fx.GraphModule] = None) -> Dict[str, int]:
    """Rewrite ``gm`` (captured on rank ``rank``'s slab of ``rows``) in place into the exact sharded graph
    taking the full input; returns the inserted collectives by kind. ``reference``: the same call
    captured on the full input; its shapes disambiguate and check the sharding of every node."""
    ref = None
    if reference is not None:
        ops = [(n.name, n.target) for n in gm.graph.nodes if n.op == "call_function"]
        full = [(n.name, n.target) for n in reference.graph.nodes if n.op == "call_function"]
        if ops != full:
            raise VAEShardingError("VAE-P: the graph captured on one rank's rows differs from the one "
                                      "captured on the full input (shape-dependent control flow)")
        ref = {n.name: tuple(n.meta["val"].shape) for n in reference.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor)}
    return VAERules(gm, rows, rank, group_name, ref).run()
