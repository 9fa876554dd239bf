"""Sequence-parallel attention: Ulysses, Ring and USP (Ulysses inside Ring).

Contract of :func:`ulysses_attention`, :func:`ring_attention`, :func:`usp_attention`: ``q``, ``k``,
``v`` are ``[B, H, S_local, D]`` (``v`` may have its own head dim; K/V heads repeated for GQA), the
sequence sharded over the group in rank order with ``seq_sizes`` (static, one per rank, each >= 1;
uneven allowed). The result is this rank's ``[B, H, S_local, Dv]`` rows of attention over the **full**
sequence in ``q.dtype``, equal to SDPA on the gathered sequence except that a fully masked query row
gives 0. ``attn_mask`` (bool or additive, broadcastable to ``[B|1, H|1, Sq, Sk]``) is either the
replicated full mask (``Sk = S``, ``Sq`` in ``{1, S}``) or a sharded key-padding mask (``Sk = S_local``,
``Sq = 1``; all-gathered once per call). ``scale`` defaults to ``1/sqrt(D)``.

Communication (world > 1): Ulysses exactly 4 ``all_to_all_single`` (q, k, v, out; with ``float8``, of e4m3
rows and their scales); Ring ``world - 1``
:func:`ring_exchange` calls (K and V together), or one ``all_gather`` with ``rotate_method="allgather"``; USP
both, on its two groups. Everything traces with
``torch.compile(fullgraph=True)``; ranks and ``seq_sizes`` are static, so a trace is per rank.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dit_passes.parallel.collectives import CollectiveCounter, all_gather, all_to_all_single, ring_exchange

__all__ = ["ROTATE_METHODS", "attention_with_lse", "fp8_rows", "from_fp8_rows", "even_shard_sizes", "gather_sequence",
           "ring_attention", "shard_sequence", "ulysses_attention", "ulysses_received", "ulysses_rows", "usp_attention",
           "usp_received", "usp_sizes"]


# --- sharding helpers ------------------------------------------------------------------------------


def even_shard_sizes(length: int, world: int) -> tuple[int, ...]:
    """Split ``length`` into ``world`` sizes differing by at most 1, larger ones first (rank order)."""
    if world < 1 or length < 0:
        raise ValueError(f"even_shard_sizes needs length >= 0 and world >= 1, got {length}, {world}")
    base, extra = divmod(length, world)
    return tuple(base + 1 if r < extra else base for r in range(world))


def shard_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's slice of the full ``x`` along ``dim`` (``sizes[rank]`` elements, rank order)."""
    sizes = _check_sizes(sizes, group, "shard_sequence")
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"shard_sequence: x has {x.shape[dim]} along dim {dim}, sizes {sizes} sum to {sum(sizes)}")
    rank = group.rank()
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: Sequence[int], *,
                    counter: CollectiveCounter | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full tensor on every rank (one all_gather). A rank may hold
    no token (a stream shorter than the group: the all-gather pads every shard to the largest)."""
    sizes = _check_sizes(sizes, group, "gather_sequence", least=0)
    return all_gather(x, dim, group, sizes, counter=counter)


def _check_sizes(sizes: Sequence[int], group: dist.ProcessGroup, where: str, least: int = 1) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != group.size():
        raise ValueError(f"{where}: seq_sizes {sizes} need one entry per rank of the group ({group.size()})")
    if max(sizes) < 1 or min(sizes) < least:
        raise ValueError(f"{where}: every rank needs at least one token, got seq_sizes {sizes}; use fewer ranks"
                         if least else f"{where}: no rank holds a token (seq_sizes {sizes})")
    return sizes


# --- local attention with log-sum-exp ----------------------------------------------------------------


def _math_attention_with_lse(q, k, v, attn_mask, scale):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    # A row with every key masked has lse = -inf; subtracting 0 instead keeps its weights exp(-inf) = 0
    # (output 0, lse -inf: it then has no weight in the merge) rather than NaN.
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(scores - safe_lse.unsqueeze(-1))
    return torch.matmul(weights, v.float()), lse


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention returning ``(out, lse)``: ``out`` ``[B,H,Sq,Dv]``, ``lse`` fp32 ``[B,H,Sq]``
    = ``logsumexp_k(q k^T * scale + mask)`` (-inf for fully masked rows, whose ``out`` is 0).

    Kernel choice: CPU without mask -> ``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA
    without mask -> flash (fp16/bf16) or memory-efficient attention with ``compute_log_sumexp``;
    masks and head dims those kernels reject -> an explicit fp32 math implementation.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    head_dim, v_dim = q.shape[-1], v.shape[-1]
    if attn_mask is None and q.device.type == "cpu" and head_dim == v_dim:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[:2]
        return out, lse.float()
    if attn_mask is None and q.device.type == "cuda" and head_dim == v_dim and head_dim % 8 == 0:
        if q.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
            return out, lse.float()
        if head_dim <= 128:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, scale=scale
            )[:2]
            # The efficient kernel pads the query dim of lse (to a multiple of 32).
            return out, lse[..., : q.shape[-2]].float()
    return _math_attention_with_lse(q, k, v, attn_mask, scale)


def _merge_partials(out, lse, part_out, part_lse):
    """Combine two softmax-normalised partial results over disjoint key sets, in fp32."""
    if out is None:
        return part_out.float(), part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + part_out.float() * torch.exp(part_lse - safe).unsqueeze(-1)
    return merged, new_lse


# --- argument checks and masks -----------------------------------------------------------------------


def _check_qkv(q, k, v, sizes, rank, where):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: q, k, v must be [B, H, S_local, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != q.shape[-1] or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree; k/v need q's batch, "
            "heads (repeat K/V heads for GQA) and sequence length, k needs q's head dim"
        )
    if q.shape[2] != sizes[rank] or k.shape[2] != sizes[rank]:
        raise ValueError(
            f"{where}: rank {rank} holds {q.shape[2]} query / {k.shape[2]} key tokens but seq_sizes[{rank}] = "
            f"{sizes[rank]} (seq_sizes={sizes})"
        )


def _full_key_mask(attn_mask, q, total, local, stages, where, counter):
    return full_key_mask(attn_mask, tuple(q.shape[:2]), total, local, stages, where, counter)


def full_key_mask(attn_mask, batch_heads, total, local, stages, where, counter):
    """Normalise ``attn_mask`` to 4-D with the key dim over the full sequence (see module doc).

    ``stages``: (group, sizes) pairs whose successive all-gathers turn a local key range into the full one.
    """
    if attn_mask is None:
        return None
    mask = attn_mask
    if mask.dim() > 4:
        raise ValueError(f"{where}: attn_mask must be at most 4-D [B, H, Sq, Sk], got {tuple(mask.shape)}")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    batch, heads = batch_heads
    if mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads):
        raise ValueError(f"{where}: attn_mask {tuple(mask.shape)} must have batch 1 or {batch} and heads 1 or {heads}")
    key_len, query_len = mask.shape[-1], mask.shape[-2]
    if key_len == total:
        if query_len not in (1, total):
            raise ValueError(
                f"{where}: a full-sequence attn_mask {tuple(mask.shape)} needs a query dim of 1 or {total} "
                "(row-sharded masks are not supported: pass the replicated mask)"
            )
        return mask
    if key_len == local:
        if query_len != 1:
            raise ValueError(
                f"{where}: a sharded attn_mask (key dim = local {local}) must be key padding [B, 1, 1, {local}], "
                f"got {tuple(mask.shape)}"
            )
        for group, sizes in stages:
            mask = all_gather(mask, -1, group, sizes, counter=counter)
        return mask
    raise ValueError(
        f"{where}: attn_mask key dim {key_len} is neither the full sequence ({total}) nor this rank's shard ({local})"
    )


def _checked_one_group(q, k, v, attn_mask, group, seq_sizes, where, counter):
    """The checked ``seq_sizes`` of an attention over one group, and its mask over the full keys."""
    sizes = _check_sizes(seq_sizes, group, where)
    _check_qkv(q, k, v, sizes, group.rank(), where)
    return sizes, _full_key_mask(attn_mask, q, sum(sizes), sizes[group.rank()], [(group, sizes)], where, counter)


# --- Ulysses -----------------------------------------------------------------------------------------


FP8_MAX = 448.0  # e4m3's largest finite value


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` as bytes ``[..., D + 4]``: each row in e4m3 scaled by its absolute maximum, then that
    fp32 scale's 4 bytes. One payload, so an fp8 all-to-all stays one collective (gloo and NCCL move bytes)."""
    xf = x.float()
    row_scale = xf.abs().amax(-1, keepdim=True).div(FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (xf / row_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, row_scale.view(torch.uint8)], dim=-1)


def from_fp8_rows(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`fp8_rows` (up to e4m3 rounding), in ``dtype``."""
    values = payload[..., :-4].contiguous().view(torch.float8_e4m3fn).float()
    return (values * payload[..., -4:].contiguous().view(torch.float32)).to(dtype)


def _all_to_all(x, output_sizes, input_sizes, group, counter, float8: bool):
    """``all_to_all_single`` along dim 0; ``float8``: the rows travel as e4m3 plus a per-row scale (a quarter
    of fp32's bytes, about half of bf16's; error ~2**-4 of each row's largest value)."""
    if not float8:
        return all_to_all_single(x, output_sizes, input_sizes, group, counter=counter)
    return from_fp8_rows(all_to_all_single(fp8_rows(x), output_sizes, input_sizes, group, counter=counter), x.dtype)


def ulysses_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    """``x [B, H, S_l, D]`` as the rows Ulysses sends: grouped by destination rank, ``[world * S_l, B, H / world, D]``
    (heads zero-padded to a multiple of ``world``); the chunks received (``S_j`` rows from rank j) concatenate to
    the full sequence in order. Local; its all-to-all may be issued as soon as ``x`` exists (async Ulysses)."""
    batch, heads, local, dim = x.shape
    per_rank = -(-heads // world)
    if per_rank * world > heads:
        x = F.pad(x, (0, 0, 0, 0, 0, per_rank * world - heads))
    return x.reshape(batch, world, per_rank, local, dim).permute(1, 3, 0, 2, 4).reshape(world * local, batch, per_rank,
                                                                                         dim).contiguous()


def ulysses_received(qh, kh, vh, mask, group, sizes, local_attention: Callable, counter, float8: bool, heads: int):
    """The second half of Ulysses: ``qh``, ``kh``, ``vh`` are the received rows ``[S, B, H / world, D]`` (after the
    q / k / v all-to-alls), ``mask`` has a full key dim and ``heads`` heads (or 1); ``local_attention`` on this
    rank's heads over the full sequence, then the all-to-all back to ``[B, heads, S_local, Dv]``."""
    world, rank = group.size(), group.rank()
    local = sizes[rank]
    batch, per_rank = qh.shape[1], qh.shape[2]
    padded_heads = per_rank * world
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (qh, kh, vh))  # [B, per_rank, S, D]
    if mask is not None and mask.shape[1] == heads and heads > 1:
        if padded_heads > heads:
            fill = mask.narrow(1, 0, 1).expand(-1, padded_heads - heads, -1, -1)
            mask = torch.cat([mask, fill], dim=1)
        mask = mask.narrow(1, rank * per_rank, per_rank)
    out = local_attention(qh, kh, vh, mask)  # [B, per_rank, S, Dv]
    v_dim = out.shape[-1]
    back = _all_to_all(out.permute(2, 0, 1, 3), [local] * world, sizes, group, counter, float8)
    back = back.reshape(world, local, batch, per_rank, v_dim).permute(2, 0, 3, 1, 4).reshape(batch, padded_heads, local, v_dim)
    return back[:, :heads]


def _ulysses(q, k, v, mask, group, sizes, scale, local_attention: Callable, counter, float8: bool = False):
    """All-to-all heads <-> sequence, ``local_attention(q, k, v, mask)`` on full-sequence head groups,
    all-to-all back. ``mask`` has a full key dim; a per-head mask is sliced to this rank's heads."""
    world, local = group.size(), q.shape[2]
    qh, kh, vh = (_all_to_all(ulysses_rows(x, world), sizes, [local] * world, group, counter, float8)
                  for x in (q, k, v))
    return ulysses_received(qh, kh, vh, mask, group, sizes, local_attention, counter, float8, q.shape[1])


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                      seq_sizes: Sequence[int], attn_mask: torch.Tensor | None = None, scale: float | None = None,
                      counter: CollectiveCounter | None = None, float8: bool = False) -> torch.Tensor:
    """Ulysses (DeepSpeed) sequence-parallel attention; see the module docstring for the contract.

    Heads not divisible by the group size are zero-padded and the padded outputs dropped. ``float8``: the four
    all-to-alls move e4m3 rows with a per-row scale (:func:`fp8_rows`): approximate, not exact."""
    sizes, mask = _checked_one_group(q, k, v, attn_mask, group, seq_sizes, "ulysses_attention", counter)

    def local_sdpa(qh, kh, vh, m):
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, scale=scale)

    if group.size() == 1:
        return local_sdpa(q, k, v, mask)
    return _ulysses(q, k, v, mask, group, sizes, scale, local_sdpa, counter, float8)


# --- Ring --------------------------------------------------------------------------------------------


ROTATE_METHODS = ("p2p", "allgather")


def _ring(q, k, v, mask, group, sizes, scale, counter, rotate: str = "p2p"):
    """Ring attention of this rank's queries (block ``rank`` of ``sizes``) over all K/V blocks.

    ``rotate="p2p"``: K/V are padded to the largest block so every exchange moves equal shapes; each step
    slices the visiting block back to its true length (known statically), so padding never enters the softmax.
    ``"allgather"``: one all-gather of K and V (concatenated on the head dim) brings every block at once, for
    networks where one collective beats ``world - 1`` dependent exchanges; the blocks are then visited in the
    p2p order, so both methods compute the same partials and merge them identically (bit-equal results).
    """
    if rotate not in ROTATE_METHODS:
        raise ValueError(f"ring attention: rotate method {rotate!r} is not one of {ROTATE_METHODS}")
    world, rank = group.size(), group.rank()
    if mask is not None and mask.shape[-2] != 1:
        mask = mask.narrow(-2, sum(sizes[:rank]), sizes[rank])  # this rank's query rows
    starts = [sum(sizes[:j]) for j in range(world)]
    if rotate == "allgather" and world > 1:
        kv_all = all_gather(torch.cat([k, v], dim=-1), 2, group, sizes, counter=counter)
        k_dim = k.shape[-1]

        def block(source):
            kv_block = kv_all.narrow(2, starts[source], sizes[source])
            return kv_block[..., :k_dim], kv_block[..., k_dim:]
    else:
        pad = max(sizes) - k.shape[2]
        kv = [F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))] if pad else [k, v]

        def block(source):
            return kv[0].narrow(2, 0, sizes[source]), kv[1].narrow(2, 0, sizes[source])
    out = lse = None
    for step in range(world):
        source = (rank - step) % world  # whose K/V block this rank holds at this step
        block_mask = None if mask is None else mask.narrow(-1, starts[source], sizes[source])
        k_block, v_block = block(source)
        part_out, part_lse = attention_with_lse(q, k_block, v_block, attn_mask=block_mask, scale=scale)
        out, lse = _merge_partials(out, lse, part_out, part_lse)
        if step < world - 1 and rotate == "p2p":
            kv = ring_exchange(kv, group, counter=counter)
    return out.to(q.dtype)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup,
                   seq_sizes: Sequence[int], attn_mask: torch.Tensor | None = None, scale: float | None = None,
                   counter: CollectiveCounter | None = None, rotate_method: str = "p2p") -> torch.Tensor:
    """Ring attention: K/V rotate around the group (``world - 1`` exchanges; ``rotate_method="allgather"``: one
    all-gather instead), partial results are merged by log-sum-exp in fp32. See the module docstring."""
    sizes, mask = _checked_one_group(q, k, v, attn_mask, group, seq_sizes, "ring_attention", counter)
    return _ring(q, k, v, mask, group, sizes, scale, counter, rotate_method)


# --- USP ---------------------------------------------------------------------------------------------


def usp_sizes(seq_sizes: Sequence[int], ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup,
              where: str) -> tuple[list[int], list[int]]:
    """``(inner, blocks)`` of a USP attention: the shards of this rank's ring block over the Ulysses group, and the
    ring blocks' lengths (the sums of each block's shards); checked."""
    ring_size, ulysses_size = ring_group.size(), ulysses_group.size()
    if len(seq_sizes) != ring_size * ulysses_size:
        raise ValueError(f"{where}: seq_sizes {list(seq_sizes)} need ring_size * ulysses_size = "
                         f"{ring_size} * {ulysses_size} entries")
    ring_rank = ring_group.rank()
    inner = [int(s) for s in seq_sizes[ring_rank * ulysses_size : (ring_rank + 1) * ulysses_size]]
    inner = _check_sizes(inner, ulysses_group, where)
    blocks = [sum(int(s) for s in seq_sizes[j * ulysses_size : (j + 1) * ulysses_size]) for j in range(ring_size)]
    return inner, _check_sizes(blocks, ring_group, where)


def _usp_mask(attn_mask, batch_heads, ulysses_group, ring_group, inner, blocks, where, counter):
    return full_key_mask(attn_mask, batch_heads, sum(blocks), inner[ulysses_group.rank()],
                         [(ulysses_group, inner), (ring_group, blocks)], where, counter)


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group: dist.ProcessGroup,
                  ring_group: dist.ProcessGroup, seq_sizes: Sequence[int], attn_mask: torch.Tensor | None = None,
                  scale: float | None = None, counter: CollectiveCounter | None = None,
                  ring_rotate_method: str = "p2p", ulysses_float8: bool = False) -> torch.Tensor:
    """Unified sequence parallelism: Ulysses over ``ulysses_group`` inside Ring over ``ring_group``.

    The sequence is sharded over ``ring_size * ulysses_size`` ranks; ``seq_sizes[i]`` is the shard
    of the rank at ``ring_rank * ulysses_size + ulysses_rank`` (the row-major order of a
    ``ParallelMesh(("ring", R), ("ulysses", U))``). Ulysses turns a ring block's shards into full
    block sequences on ``H / U`` heads; ring attention then runs over the blocks.
    """
    inner, blocks = usp_sizes(seq_sizes, ulysses_group, ring_group, "usp_attention")
    _check_qkv(q, k, v, inner, ulysses_group.rank(), "usp_attention")
    mask = _usp_mask(attn_mask, tuple(q.shape[:2]), ulysses_group, ring_group, inner, blocks, "usp_attention", counter)

    def ring_over_blocks(qh, kh, vh, m):
        return _ring(qh, kh, vh, m, ring_group, blocks, scale, counter, ring_rotate_method)

    if ulysses_group.size() == 1:
        return ring_over_blocks(q, k, v, mask)
    return _ulysses(q, k, v, mask, ulysses_group, inner, scale, ring_over_blocks, counter, ulysses_float8)


def usp_received(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, *, ulysses_group: dist.ProcessGroup,
                 ring_group: dist.ProcessGroup, seq_sizes: Sequence[int], heads: int,
                 attn_mask: torch.Tensor | None = None, scale: float | None = None,
                 counter: CollectiveCounter | None = None, ring_rotate_method: str = "p2p",
                 ulysses_float8: bool = False) -> torch.Tensor:
    """:func:`usp_attention` after its q / k / v all-to-alls over ``ulysses_group`` (async Ulysses issues them
    itself): ``*h`` are the received rows ``[S_block, B, H / U, D]`` of q, k, v (``heads``: H); the same ops as
    :func:`usp_attention` from there on (ring attention over the blocks, the output all-to-all), so the same bits."""
    inner, blocks = usp_sizes(seq_sizes, ulysses_group, ring_group, "usp_received")
    mask = _usp_mask(attn_mask, (qh.shape[1], heads), ulysses_group, ring_group, inner, blocks, "usp_received",
                     counter)

    def ring_over_blocks(q, k, v, m):
        return _ring(q, k, v, m, ring_group, blocks, scale, counter, ring_rotate_method)

    return ulysses_received(qh, kh, vh, mask, ulysses_group, inner, ring_over_blocks, counter, ulysses_float8, heads)
