"""Graph-callable wrappers the context-parallel passes insert (``shard_sequence``, ``permute_sequence``,
``gather_sequence``, ``ulysses_attention``, ``ring_attention``, ``usp_attention``, and their forms with the
ring's K / V by one all-gather or the Ulysses all-to-alls in fp8).

They take tensors plus static constants (run lists ``(starts, lengths)`` along one dim: the result is
the concatenation of ``x.narrow(dim, start, length)``, process group *names* resolved at call time),
so a rewritten graph prints, pickles and deep-copies like an ATen graph. ``*_shape`` give the output
on fake tensors, for ``meta["val"]``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import attention as _attn
from .collectives import resolve_group


def shard_sequence(x: torch.Tensor, dim: int, starts: Sequence[int], lengths: Sequence[int],
                   order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """This rank's part of the full ``x`` along ``dim``: the concatenation of its runs. Local. One run is a
    view of ``x`` (``x``'s memory order); several are copied, in memory ``order`` when given (see :func:`_in_order`)."""
    pieces = [x.narrow(dim, int(s), int(n)) for s, n in zip(starts, lengths) if int(n) > 0]
    if not pieces:
        return x.narrow(dim, 0, 0)
    if len(pieces) == 1:
        return pieces[0]
    out = torch.cat(pieces, dim=dim)
    return out if order is None else _in_order(out, order)


def permute_sequence(x: torch.Tensor, dims: Sequence[int], starts: Sequence[int],
                     lengths: Sequence[int]) -> torch.Tensor:
    """Reorder the full ``x`` along each of ``dims`` by the same runs (a mask's key and query dims). Local."""
    for d in dims:
        x = shard_sequence(x, d, starts, lengths)
    return x


def gather_sequence(x: torch.Tensor, dim: int, group_name: str, rank_lengths: Sequence[int],
                    starts: Sequence[int], lengths: Sequence[int],
                    order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather the shards along ``dim`` (one ``all_gather``, uneven ``rank_lengths`` allowed, a rank may hold
    none), then reorder by the runs (empty runs: the gathered order is already the original one). ``order``: the
    memory order of the value the gather stands for (see :func:`_in_order`), default contiguous."""
    full = _attn.gather_sequence(x, dim, resolve_group(group_name), list(rank_lengths))
    full = shard_sequence(full, dim, starts, lengths) if len(starts) else full
    return full if order is None else _in_order(full, order)


def gather_sequence_shape(x, dim, group_name, rank_lengths, starts, lengths, order=None):
    shape = list(x.shape)
    shape[dim] = sum(int(n) for n in rank_lengths)
    out = x.new_empty(shape)
    return out if order is None else _in_order(out, order)


def _in_order(out: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``out`` laid out in memory ``order`` (dims from outermost), the order the traced value had: the ops
    after it may depend on it (SDPA's output follows its query's layout; export wrote ``view`` where the
    traced layout allowed one, so a gathered or attended value in another layout would fail there)."""
    order = [int(d) for d in order]
    if order == list(range(out.dim())):
        return out.contiguous()
    inverse = [order.index(d) for d in range(out.dim())]
    return out.permute(order).contiguous().permute(inverse)


def _like_q(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` (k or v) broadcast to q's batch and heads, as SDPA broadcasts them (OmniGen: one K/V head)."""
    return x if x.shape[:2] == q.shape[:2] else x.expand(q.shape[0], q.shape[1], *x.shape[2:])


# the attention functions of :mod:`~dit_passes.parallel.attention` on named groups, output in ``out_order``; k and v
# broadcast over batch / heads like SDPA's
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      group_name: str, seq_sizes: Sequence[int], scale: Optional[float],
                      out_order: Sequence[int]) -> torch.Tensor:
    return _one_group(_attn.ulysses_attention, q, k, v, attn_mask, group_name, seq_sizes, scale, out_order)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   group_name: str, seq_sizes: Sequence[int], scale: Optional[float],
                   out_order: Sequence[int]) -> torch.Tensor:
    return _one_group(_attn.ring_attention, q, k, v, attn_mask, group_name, seq_sizes, scale, out_order)


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  ulysses_group_name: str, ring_group_name: str, seq_sizes: Sequence[int],
                  scale: Optional[float], out_order: Sequence[int]) -> torch.Tensor:
    return _usp(q, k, v, attn_mask, ulysses_group_name, ring_group_name, seq_sizes, scale, out_order)


# The same with options, each form its own function so a printed graph says which collectives run:
# ``allgather``: the ring's K / V by one all-gather; ``fp8``: the Ulysses all-to-alls in e4m3 rows + scales.
def ring_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                             group_name: str, seq_sizes: Sequence[int], scale: Optional[float],
                             out_order: Sequence[int]) -> torch.Tensor:
    return _one_group(_attn.ring_attention, q, k, v, attn_mask, group_name, seq_sizes, scale, out_order,
                      rotate_method="allgather")


def ulysses_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                          group_name: str, seq_sizes: Sequence[int], scale: Optional[float],
                          out_order: Sequence[int]) -> torch.Tensor:
    return _one_group(_attn.ulysses_attention, q, k, v, attn_mask, group_name, seq_sizes, scale, out_order,
                      float8=True)


def _one_group(attention, q, k, v, attn_mask, group_name, seq_sizes, scale, out_order, **options):
    k, v = _like_q(q, k), _like_q(q, v)
    return _in_order(attention(q, k, v, group=resolve_group(group_name), seq_sizes=list(seq_sizes),
                               attn_mask=attn_mask, scale=scale, **options), out_order)


def _usp(q, k, v, attn_mask, ulysses_group_name, ring_group_name, seq_sizes, scale, out_order, **options):
    k, v = _like_q(q, k), _like_q(q, v)
    return _in_order(_attn.usp_attention(q, k, v, ulysses_group=resolve_group(ulysses_group_name),
                                         ring_group=resolve_group(ring_group_name), seq_sizes=list(seq_sizes),
                                         attn_mask=attn_mask, scale=scale, **options), out_order)


def usp_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                            ulysses_group_name: str, ring_group_name: str, seq_sizes: Sequence[int],
                            scale: Optional[float], out_order: Sequence[int]) -> torch.Tensor:
    return _usp(q, k, v, attn_mask, ulysses_group_name, ring_group_name, seq_sizes, scale, out_order,
                ring_rotate_method="allgather")


def usp_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      ulysses_group_name: str, ring_group_name: str, seq_sizes: Sequence[int],
                      scale: Optional[float], out_order: Sequence[int]) -> torch.Tensor:
    return _usp(q, k, v, attn_mask, ulysses_group_name, ring_group_name, seq_sizes, scale, out_order,
                ulysses_float8=True)


def usp_fp8_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                                ulysses_group_name: str, ring_group_name: str, seq_sizes: Sequence[int],
                                scale: Optional[float], out_order: Sequence[int]) -> torch.Tensor:
    return _usp(q, k, v, attn_mask, ulysses_group_name, ring_group_name, seq_sizes, scale, out_order,
                ulysses_float8=True, ring_rotate_method="allgather")


def attention_shape(q, k, v, attn_mask, *static):
    """Output of any of the attention wrappers: ``q``'s shape with ``v``'s head dim, in the memory
    order given by the last static argument."""
    return _in_order(q.new_empty((*q.shape[:-1], v.shape[-1])), static[-1])


# Async Ulysses (``Ulysses(async_qkv=True)``): the q / k / v all-to-alls are graph nodes of their own
# (``_c10d_functional.all_to_all_single`` on :func:`ulysses_rows`, its ``wait_tensor`` later), and
# :func:`ulysses_received_attention` runs the rest: the same ops as :func:`ulysses_attention`, so the same bits.
def ulysses_rows(x: torch.Tensor, batch: int, heads: int, world: int) -> torch.Tensor:
    """``x`` (broadcast to ``[batch, heads]`` like SDPA's k / v) as the rows its all-to-all sends. Local."""
    if tuple(x.shape[:2]) != (batch, heads):
        x = x.expand(batch, heads, *x.shape[2:])
    return _attn.ulysses_rows(x, world)


def ulysses_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                               attn_mask: Optional[torch.Tensor], group_name: str, seq_sizes: Sequence[int],
                               scale: Optional[float], out_order: Sequence[int], heads: int) -> torch.Tensor:
    """Ulysses attention after the q / k / v all-to-alls (``*h``: the received rows ``[S, B, H / world, D]``):
    attention on this rank's heads, the output's all-to-all back (one collective), in ``out_order``."""
    group = resolve_group(group_name)
    sizes = [int(s) for s in seq_sizes]
    mask = _attn.full_key_mask(attn_mask, (qh.shape[1], heads), sum(sizes), sizes[group.rank()], [(group, sizes)],
                               "ulysses_received_attention", None)

    def local_sdpa(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)

    out = _attn.ulysses_received(qh, kh, vh, mask, group, sizes, local_sdpa, None, False, heads)
    return _in_order(out, out_order)


def ulysses_received_shape(qh, kh, vh, attn_mask, group_name, seq_sizes, scale, out_order, heads):
    rank = resolve_group(group_name).rank()
    return _in_order(qh.new_empty((qh.shape[1], heads, int(seq_sizes[rank]), vh.shape[-1])), out_order)
