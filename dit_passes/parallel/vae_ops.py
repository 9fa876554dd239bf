"""The custom ops VAE-P inserts (``dit_passes::vae_halo_exchange``: neighbours' boundary rows, zeros on
the global edges, one ``batch_isend_irecv``; ``vae_group_stats`` / ``vae_group_norm_apply``: float64
``[count, sum, sum of squares]`` per (batch, group), all-reduced, then local normalisation), the row
split and the activation accounting of the report.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from . import op_classes as oc
from .collectives import resolve_group
from .propagate import val as _val

__all__ = ["halo_exchange", "group_stats", "group_norm_apply", "halo_rows", "split_rows", "activation_memory",
           "census"]

aten = torch.ops.aten


def halo_rows(rank: int, world: int, before: int, after: int, edge_before: int, edge_after: int) -> tuple:
    """Rows added above and below this rank's slab by :func:`halo_exchange`."""
    return (edge_before if rank == 0 else before, edge_after if rank == world - 1 else after)


@torch.library.custom_op("dit_passes::vae_halo_exchange", mutates_args=())
def halo_exchange(x: torch.Tensor, dim: int, before: int, after: int, edge_before: int, edge_after: int,
                  group_name: str) -> torch.Tensor:
    """``x`` (this rank's slab along ``dim``) with ``before`` rows of the previous rank prepended and
    ``after`` rows of the next rank appended; rank 0 prepends ``edge_before`` zero rows and the last
    rank appends ``edge_after`` zero rows instead (the convolution's global padding). Every rank
    passes the same arguments: rank r sends its first ``after`` rows to r - 1 and its last ``before``
    rows to r + 1, all in one ``batch_isend_irecv``."""
    group = resolve_group(group_name)
    rank, world = group.rank(), group.size()
    top_n, bottom_n = halo_rows(rank, world, before, after, edge_before, edge_after)
    dim %= x.dim()
    top = x.new_zeros(x.shape[:dim] + (top_n,) + x.shape[dim + 1:])  # received rows, or zeros on the global edges
    bottom = x.new_zeros(x.shape[:dim] + (bottom_n,) + x.shape[dim + 1:])
    length = x.shape[dim]
    ops = []
    if rank > 0:
        prev = dist.get_global_rank(group, rank - 1)
        if after:
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, 0, after).contiguous(), prev, group))
        if before:
            ops.append(dist.P2POp(dist.irecv, top, prev, group))
    if rank < world - 1:
        nxt = dist.get_global_rank(group, rank + 1)
        if before:
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, length - before, before).contiguous(), nxt, group))
        if after:
            ops.append(dist.P2POp(dist.irecv, bottom, nxt, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    pieces = [p for p in (top, x, bottom) if p.shape[dim] > 0]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else x.clone()


@halo_exchange.register_fake
def _(x, dim, before, after, edge_before, edge_after, group_name):
    group = resolve_group(group_name)
    top_n, bottom_n = halo_rows(group.rank(), group.size(), before, after, edge_before, edge_after)
    shape = list(x.shape)
    shape[dim] += top_n + bottom_n
    return x.new_empty(shape)


@torch.library.custom_op("dit_passes::vae_group_stats", mutates_args=())
def group_stats(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per (batch, group) ``[count, sum, sum of squares]`` of the local ``x`` (N, C, *spatial), in
    float64. Built from ``var_mean`` (stable two-pass) so that summing over ranks and recovering the
    variance in float64 loses nothing measurable."""
    n = x.shape[0]
    xg = x.reshape(n, num_groups, -1)
    if xg.dtype not in (torch.float32, torch.float64):
        xg = xg.float()
    count = xg.shape[-1]
    var, mean = torch.var_mean(xg, dim=-1, correction=0)
    mean, var = mean.double(), var.double()
    total = mean * count
    squares = (var + mean * mean) * count
    return torch.stack([torch.full_like(total, float(count)), total, squares], dim=-1)


@group_stats.register_fake
def _(x, num_groups):
    return x.new_empty((x.shape[0], num_groups, 3), dtype=torch.float64)


@torch.library.custom_op("dit_passes::vae_group_norm_apply", mutates_args=())
def group_norm_apply(x: torch.Tensor, stats: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Normalise the local ``x`` with the global statistics ``stats`` (the all-reduced output of
    :func:`group_stats`), then apply the per-channel affine ``weight`` / ``bias``."""
    n, c = x.shape[0], x.shape[1]
    count, total, squares = stats.unbind(-1)
    mean = total / count
    var = (squares / count - mean * mean).clamp_min(0.0)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rstd = torch.rsqrt(var + eps).to(compute)                       # (N, G)
    mean = mean.to(compute)
    per = c // num_groups
    scale = rstd.repeat_interleave(per, dim=1)                      # (N, C)
    shift = -mean.repeat_interleave(per, dim=1) * scale
    if weight is not None:
        scale = scale * weight.to(compute)
        shift = shift * weight.to(compute)
    if bias is not None:
        shift = shift + bias.to(compute)
    bshape = (n, c) + (1,) * (x.dim() - 2)
    xc = x if x.dtype == compute else x.to(compute)
    out = torch.addcmul(shift.reshape(bshape), xc, scale.reshape(bshape))
    return out if out.dtype == x.dtype else out.to(x.dtype)


@group_norm_apply.register_fake
def _(x, stats, num_groups, weight, bias, eps):
    return torch.empty_like(x)


def split_rows(total: int, world: int, unit: int = 1) -> List[int]:
    """Rows per rank: ``total`` split as evenly as possible in multiples of ``unit`` (the first ranks
    take one unit more; a remainder below ``unit`` goes to the last rank)."""
    units, rest = divmod(total, unit)
    if units < world:
        raise ValueError(f"VAE-P: height {total} is too small for {world} ranks"
                         + (f" in blocks of {unit} rows" if unit > 1 else ""))
    base, extra = divmod(units, world)
    rows = [(base + (1 if r < extra else 0)) * unit for r in range(world)]
    rows[-1] += rest
    return rows


def activation_memory(gm: fx.GraphModule) -> Dict[str, int]:
    """Bytes from the graph's ``meta['val']``: the largest single activation and the peak of the live
    activations in graph order (views share their base; attention adds its score matrix while it
    runs). Parameters are not counted. An estimate of the allocator's peak, comparable across graphs."""
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    pos = {n: i for i, n in enumerate(nodes)}
    root: Dict[fx.Node, fx.Node] = {}
    size: Dict[fx.Node, int] = {}
    last: Dict[fx.Node, int] = {}
    largest, extra = 0, {}
    for n in nodes:
        v = _val(n)
        if n.op == "call_function" and n.target in oc.ALIASES and n.all_input_nodes:
            root[n] = root.get(n.args[0], n.args[0]) if isinstance(n.args[0], fx.Node) else n
        else:
            root[n] = n
            size[n] = sum(t.numel() * t.element_size() for t in (v if isinstance(v, (list, tuple)) else [v])
                          if isinstance(t, torch.Tensor))
            largest = max(largest, size[n])
        if n.target is aten.scaled_dot_product_attention.default:
            q, k = _val(n.args[0]), _val(n.args[1])
            extra[n] = q.numel() // q.shape[-1] * k.shape[-2] * q.element_size()
        for a in n.all_input_nodes:
            if a in root:
                last[root[a]] = max(last.get(root[a], 0), pos[n])
    for o in gm.graph.output_node().all_input_nodes:
        if o in root:
            last[root[o]] = len(nodes)
    live = peak = 0
    ends: Dict[int, int] = collections.Counter()
    for i, n in enumerate(nodes):
        if root[n] is n:
            live += size[n]
            ends[last.get(n, i)] += size[n]
        peak = max(peak, live + extra.get(n, 0))
        live -= ends.pop(i, 0)
    return {"largest_activation_bytes": largest, "peak_activation_bytes": peak}


def census(gm: fx.GraphModule) -> Dict[str, int]:
    """What the rewrite has to handle in a single-process graph."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {"convs_taller_than_one_row": sum(1 for n in nodes if n.target in oc.CONVS and _val(n.args[1]).shape[-2] > 1),
            "group_norms": sum(1 for n in nodes if n.target is aten.group_norm.default),
            "attentions": sum(1 for n in nodes if n.target is aten.scaled_dot_product_attention.default)}
