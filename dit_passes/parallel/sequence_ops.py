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


# Async Ulysses (``Ulysses(async_qkv=True)``, ``USP(ulysses_async=True)``): the q / k / v all-to-alls are graph
# nodes of their own (``_c10d_functional.all_to_all_single`` on :func:`ulysses_rows`, or on :func:`ulysses_fp8_rows`
# decoded by :func:`from_fp8_rows` after their ``wait_tensor``), and the ``*_received_attention`` wrappers run the
# rest: the same ops as the synchronous wrappers of the same name, so the same bits.
def ulysses_rows(x: torch.Tensor, batch: int, heads: int, world: int) -> torch.Tensor:
    """``x`` (broadcast to ``[batch, heads]`` like SDPA's k / v) as the rows its all-to-all sends. Local."""
    if tuple(x.shape[:2]) != (batch, heads):
        x = x.expand(batch, heads, *x.shape[2:])
    return _attn.ulysses_rows(x, world)


def ulysses_fp8_rows(x: torch.Tensor, batch: int, heads: int, world: int) -> torch.Tensor:
    """:func:`ulysses_rows` as the e4m3 bytes + per-row scale the float8 all-to-all sends. Local."""
    return _attn.fp8_rows(ulysses_rows(x, batch, heads, world))


def from_fp8_rows(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received float8 rows back in ``dtype``. Local."""
    return _attn.from_fp8_rows(payload, dtype)


def _received(qh, kh, vh, attn_mask, groups, seq_sizes, scale, out_order, heads, float8=False, rotate="p2p"):
    """Ulysses (one group name) or USP (the Ulysses then the ring group name) after the q / k / v all-to-alls."""
    sizes = [int(s) for s in seq_sizes]
    if len(groups) == 2:
        out = _attn.usp_received(qh, kh, vh, ulysses_group=resolve_group(groups[0]),
                                 ring_group=resolve_group(groups[1]), seq_sizes=sizes, heads=heads,
                                 attn_mask=attn_mask, scale=scale, ring_rotate_method=rotate, ulysses_float8=float8)
        return _in_order(out, out_order)
    group = resolve_group(groups[0])
    mask = _attn.full_key_mask(attn_mask, (qh.shape[1], heads), sum(sizes), sizes[group.rank()], [(group, sizes)],
                               "ulysses_received_attention", None)

    def local_sdpa(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)

    return _in_order(_attn.ulysses_received(qh, kh, vh, mask, group, sizes, local_sdpa, None, float8, heads), out_order)


def ulysses_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                               attn_mask: Optional[torch.Tensor], group_name: str, seq_sizes: Sequence[int],
                               scale: Optional[float], out_order: Sequence[int], heads: int) -> torch.Tensor:
    """Ulysses attention after the q / k / v all-to-alls (``*h``: the received rows ``[S, B, H / world, D]``):
    attention on this rank's heads, the output's all-to-all back (one collective), in ``out_order``."""
    return _received(qh, kh, vh, attn_mask, (group_name,), seq_sizes, scale, out_order, heads)


def ulysses_fp8_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                                   attn_mask: Optional[torch.Tensor], group_name: str, seq_sizes: Sequence[int],
                                   scale: Optional[float], out_order: Sequence[int], heads: int) -> torch.Tensor:
    return _received(qh, kh, vh, attn_mask, (group_name,), seq_sizes, scale, out_order, heads, float8=True)


def usp_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, attn_mask: Optional[torch.Tensor],
                           ulysses_group_name: str, ring_group_name: str, seq_sizes: Sequence[int],
                           scale: Optional[float], out_order: Sequence[int], heads: int) -> torch.Tensor:
    """USP after the q / k / v all-to-alls over the Ulysses group (``*h``: a ring block's rows on this rank's heads):
    ring attention over the blocks, the output's all-to-all back, in ``out_order``."""
    return _received(qh, kh, vh, attn_mask, (ulysses_group_name, ring_group_name), seq_sizes, scale, out_order, heads)


def usp_fp8_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                               attn_mask: Optional[torch.Tensor], ulysses_group_name: str, ring_group_name: str,
                               seq_sizes: Sequence[int], scale: Optional[float], out_order: Sequence[int],
                               heads: int) -> torch.Tensor:
    return _received(qh, kh, vh, attn_mask, (ulysses_group_name, ring_group_name), seq_sizes, scale, out_order, heads,
                     float8=True)


def usp_allgather_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                                     attn_mask: Optional[torch.Tensor], ulysses_group_name: str, ring_group_name: str,
                                     seq_sizes: Sequence[int], scale: Optional[float], out_order: Sequence[int],
                                     heads: int) -> torch.Tensor:
    return _received(qh, kh, vh, attn_mask, (ulysses_group_name, ring_group_name), seq_sizes, scale, out_order, heads,
                     rotate="allgather")


def usp_fp8_allgather_received_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                                         attn_mask: Optional[torch.Tensor], ulysses_group_name: str,
                                         ring_group_name: str, seq_sizes: Sequence[int], scale: Optional[float],
                                         out_order: Sequence[int], heads: int) -> torch.Tensor:
    return _received(qh, kh, vh, attn_mask, (ulysses_group_name, ring_group_name), seq_sizes, scale, out_order, heads,
                     float8=True, rotate="allgather")


def received_shape(qh, kh, vh, attn_mask, *static):
    """Output of any ``*_received_attention`` wrapper: ``[B, heads, S_local, Dv]`` in ``out_order``, ``S_local`` this
    rank's entry of ``seq_sizes`` (rank ``ring_rank * U + ulysses_rank`` of a USP mesh)."""
    *groups, seq_sizes, _scale, out_order, heads = static
    ulysses = resolve_group(groups[0])
    rank = ulysses.rank() + (resolve_group(groups[1]).rank() * ulysses.size() if len(groups) == 2 else 0)
    return _in_order(qh.new_empty((qh.shape[1], heads, int(seq_sizes[rank]), vh.shape[-1])), out_order)
