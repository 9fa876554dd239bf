"""Sequence-parallel attention, collectives, mesh and the multi-rank harness, on gloo CPU ranks.

Each world size is spawned once: the rank functions below run every check inside one process group
and return errors / counts, which the driver-side tests assert on.
"""

from __future__ import annotations

import math
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dit_passes.parallel.attention import (
    attention_with_lse,
    even_shard_sizes,
    gather_sequence,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    usp_attention,
)
from dit_passes.parallel.collectives import CollectiveCounter, all_gather, all_reduce, all_to_all_single
from dit_passes.parallel.mesh import MeshError, ParallelMesh, factorisations
from dit_passes.testing import RankFailedError, RankTimeoutError, run_ranks

TOL = 1e-5
FP8_TOL = 0.08  # ulysses float8 vs exact attention (max abs error / max abs): measured 0.029-0.056 on these cases


def _max_rel(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _inputs(batch, heads, seq, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3)]


def _key_padding(batch, seq):
    mask = torch.ones(batch, 1, 1, seq, dtype=torch.bool)
    mask[1, ..., seq - 4 :] = False  # sample 1: last 4 tokens are padding
    return mask


def _dense_mask(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, 1, seq, seq, generator=g) > 0.4
    mask[..., 0] = True  # every query row keeps at least one key
    return mask


def _comm_counts(fn):
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        fn()
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _check_case(name, attention, group, sizes, heads, seq, mask_kind, errors, batch=2, dim=8):
    """Run one attention variant on this rank's shard and record its error vs full-sequence SDPA."""
    q, k, v = _inputs(batch, heads, seq, dim, seed=seq * 31 + heads)
    mask = None
    if mask_kind == "key_padding":
        mask = _key_padding(batch, seq)
    elif mask_kind == "dense":
        mask = _dense_mask(batch, seq, seed=seq)
    elif mask_kind == "additive":
        mask = torch.randn(batch, heads, seq, seq, generator=torch.Generator().manual_seed(7))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    local_mask = mask
    if mask_kind == "sharded_key_padding":
        full = _key_padding(batch, seq)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
        local_mask = shard_sequence(full, -1, group, sizes)
    shard = [shard_sequence(t, 2, group, sizes) for t in (q, k, v)]
    out = attention(*shard, attn_mask=local_mask)
    if out.shape != shard[0].shape:
        errors[name] = float("inf")
        return
    errors[name] = _max_rel(out, shard_sequence(expected, 2, group, sizes))
    # The outputs gathered back must equal the full reference too (checks rank order of shards).
    errors[name + "/gathered"] = _max_rel(gather_sequence(out, 2, group, sizes), expected)


def _attention_checks(rank, world):
    group = dist.group.WORLD
    errors, counts = {}, {}
    for seq in (12, 13):
        sizes = even_shard_sizes(seq, world)
        for mask_kind in (None, "key_padding", "sharded_key_padding", "dense", "additive"):
            for heads in (4, 3):
                if heads == 3 and world != 2:
                    continue
                tag = f"S{seq}/H{heads}/{mask_kind}"
                kw = dict(group=group, seq_sizes=sizes)
                _check_case(f"ulysses/{tag}", lambda *a, **m: ulysses_attention(*a, **kw, **m), group, sizes, heads, seq, mask_kind, errors)
                _check_case(f"ring/{tag}", lambda *a, **m: ring_attention(*a, **kw, **m), group, sizes, heads, seq, mask_kind, errors)
                _check_case(f"ring_allgather/{tag}", lambda *a, **m: ring_attention(*a, **kw, rotate_method="allgather", **m),
                            group, sizes, heads, seq, mask_kind, errors)

    # float8 all-to-alls: approximate; the error vs the exact collective is recorded (bounded by the test)
    for mask_kind in (None, "key_padding"):
        for seq in (12, 13):
            sizes = even_shard_sizes(seq, world)
            fp8_errors = {}
            _check_case("x", lambda *a, **m: ulysses_attention(*a, group=group, seq_sizes=sizes, float8=True, **m),
                        group, sizes, 4, seq, mask_kind, fp8_errors)
            counts[f"ulysses_fp8_error/S{seq}/{mask_kind}"] = fp8_errors["x"]

    # Exact collective counts per call, by our counter and by CommDebugMode (functional ops).
    sizes = even_shard_sizes(13, world)
    q, k, v = (shard_sequence(t, 2, group, sizes) for t in _inputs(2, 4, 13, 8, seed=0))
    local_pad = shard_sequence(_key_padding(2, 13), -1, group, sizes)
    for name, fn in (
        ("ulysses", lambda c, m=None: ulysses_attention(q, k, v, group=group, seq_sizes=sizes, attn_mask=m, counter=c)),
        ("ring", lambda c, m=None: ring_attention(q, k, v, group=group, seq_sizes=sizes, attn_mask=m, counter=c)),
        ("ring_allgather", lambda c, m=None: ring_attention(q, k, v, group=group, seq_sizes=sizes, attn_mask=m, counter=c,
                                                            rotate_method="allgather")),
        ("ulysses_fp8", lambda c, m=None: ulysses_attention(q, k, v, group=group, seq_sizes=sizes, attn_mask=m, counter=c,
                                                            float8=True)),
    ):
        counter = CollectiveCounter()
        counts[name] = dict(_comm_counts(lambda: fn(counter)), counter=dict(counter.counts))
        counter = CollectiveCounter()
        counts[name + "/sharded_mask"] = dict(_comm_counts(lambda: fn(counter, local_pad)), counter=dict(counter.counts))

    # Collective wrappers against hand-computed expectations.
    x = torch.arange(6.0) + 10 * rank
    errors["all_reduce/sum"] = _max_rel(all_reduce(x, group), sum(torch.arange(6.0) + 10 * r for r in range(world)))
    errors["all_reduce/avg"] = _max_rel(all_reduce(x, group, "avg"), sum(torch.arange(6.0) + 10 * r for r in range(world)) / world)
    uneven = [r + 1 for r in range(world)]
    gathered = all_gather(torch.full((2, uneven[rank]), float(rank)), 1, group, uneven)
    errors["all_gather/uneven"] = _max_rel(gathered, torch.cat([torch.full((2, r + 1), float(r)) for r in range(world)], 1))
    # all_to_all with uneven splits: rank r sends j+1 rows of value 100r+j to rank j.
    send = torch.cat([torch.full((j + 1, 3), 100.0 * rank + j) for j in range(world)])
    received = all_to_all_single(send, [rank + 1] * world, [j + 1 for j in range(world)], group)
    errors["all_to_all/uneven"] = _max_rel(received, torch.cat([torch.full((rank + 1, 3), 100.0 * j + rank) for j in range(world)]))

    # Traceable with fullgraph=True (aot_eager: checks Dynamo + AOT tracing without Inductor's cost).
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda a, b, c, f=fn: f(a, b, c, group=group, seq_sizes=sizes), fullgraph=True, backend="aot_eager"
        )
        errors[f"compiled/{name}"] = _max_rel(compiled(q, k, v), ulysses_attention(q, k, v, group=group, seq_sizes=sizes))

    # Mesh: sizes that do not multiply to the world size give a clear error.
    try:
        ParallelMesh({"ring": 3, "ulysses": 1, "tp": 1})
        counts["mesh_error"] = None
    except MeshError as error:
        counts["mesh_error"] = str(error)
    mesh = ParallelMesh({"ring": 1, "ulysses": world, "tp": 1})
    counts["mesh"] = {n: (mesh.rank(n), mesh.size(n), mesh.ranks_along(n)) for n in mesh.names}
    return errors, counts


def _usp_checks(rank, world):
    mesh = ParallelMesh({"ring": 2, "ulysses": 2})
    # The same layout built over a non-WORLD group goes through new_group.
    sub_mesh = ParallelMesh([("ring", 2), ("ulysses", 2)], group=dist.new_group(list(range(world))))
    layout = {n: (mesh.rank(n), mesh.ranks_along(n), sub_mesh.rank(n), sub_mesh.ranks_along(n)) for n in mesh.names}
    ring, ulysses = mesh.group("ring"), mesh.group("ulysses")
    errors, counts = {}, {}
    for seq in (12, 13):
        sizes = even_shard_sizes(seq, world)
        for heads in (4, 3):
            for mask_kind in (None, "key_padding", "sharded_key_padding", "dense"):
                attn = lambda *a, **m: usp_attention(*a, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes, **m)
                _check_case(f"usp/S{seq}/H{heads}/{mask_kind}", attn, dist.group.WORLD, sizes, heads, seq, mask_kind, errors)
    sizes = even_shard_sizes(13, world)
    q, k, v = (shard_sequence(t, 2, dist.group.WORLD, sizes) for t in _inputs(2, 4, 13, 8, seed=0))
    counter = CollectiveCounter()
    counts["usp"] = dict(
        _comm_counts(lambda: usp_attention(q, k, v, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes, counter=counter)),
        counter=dict(counter.counts),
    )
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b, c: usp_attention(a, b, c, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes),
        fullgraph=True, backend="aot_eager",
    )
    errors["compiled/usp"] = _max_rel(compiled(q, k, v), usp_attention(q, k, v, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes))
    # Plain ring over 4 ranks as well (3 exchanges), and the all-gathered forms (bit-equal to the exchanges).
    counter = CollectiveCounter()
    p2p = ring_attention(q, k, v, group=dist.group.WORLD, seq_sizes=sizes, counter=counter)
    counts["ring4"] = dict(counter.counts)
    counter = CollectiveCounter()
    gathered = ring_attention(q, k, v, group=dist.group.WORLD, seq_sizes=sizes, counter=counter, rotate_method="allgather")
    counts["ring4_allgather"] = dict(counter.counts, equal=torch.equal(gathered, p2p))
    counter = CollectiveCounter()
    gathered = usp_attention(q, k, v, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes, counter=counter,
                             ring_rotate_method="allgather")
    p2p = usp_attention(q, k, v, ulysses_group=ulysses, ring_group=ring, seq_sizes=sizes)
    counts["usp_allgather"] = dict(counter.counts, equal=torch.equal(gathered, p2p))
    return errors, counts, layout


@pytest.fixture(scope="session")
def two_ranks():
    return run_ranks(_attention_checks, 2, timeout=120)


@pytest.fixture(scope="session")
def four_ranks():
    return run_ranks(_usp_checks, 4, timeout=120)


def _assert_errors(results):
    for rank, (errors, *_rest) in enumerate(results):
        bad = {name: e for name, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank}: max rel error above {TOL}: {bad}"


def test_ulysses_and_ring_match_sdpa_on_two_ranks(two_ranks):
    _assert_errors(two_ranks)
    names = two_ranks[0][0]
    # Both variants ran every case: even / uneven sequence, 3 heads, each mask layout, compiled.
    assert {"ulysses/S13/H3/None", "ring/S13/H4/sharded_key_padding", "ulysses/S13/H4/dense", "compiled/ring"} <= set(names)


def test_usp_matches_sdpa_on_four_ranks(four_ranks):
    _assert_errors(four_ranks)
    assert {"usp/S13/H3/key_padding", "usp/S13/H4/sharded_key_padding", "compiled/usp"} <= set(four_ranks[0][0])


def test_collective_counts(two_ranks, four_ranks):
    for _errors, counts in two_ranks:
        assert counts["ulysses"] == {"all_to_all_single": 4, "counter": {"all_to_all": 4}}
        # Ring P2P is invisible to CommDebugMode; our counter sees world - 1 = 1 exchange.
        assert counts["ring"] == {"counter": {"ring_exchange": 1}}
        assert counts["ulysses/sharded_mask"] == {"all_to_all_single": 4, "all_gather_into_tensor": 1, "counter": {"all_to_all": 4, "all_gather": 1}}
        assert counts["ring/sharded_mask"] == {"all_gather_into_tensor": 1, "counter": {"ring_exchange": 1, "all_gather": 1}}
        # rotate_method="allgather": K and V together in one all-gather, no exchange
        assert counts["ring_allgather"] == {"all_gather_into_tensor": 1, "counter": {"all_gather": 1}}
        assert counts["ring_allgather/sharded_mask"] == {"all_gather_into_tensor": 2, "counter": {"all_gather": 2}}
        # ulysses float8: still 4 all-to-alls (values and scales in one byte payload per tensor)
        assert counts["ulysses_fp8"] == {"all_to_all_single": 4, "counter": {"all_to_all": 4}}
        fp8 = {k: e for k, e in counts.items() if k.startswith("ulysses_fp8_error/")}
        assert len(fp8) == 4 and all(0 < e <= FP8_TOL for e in fp8.values()), fp8
    for _errors, counts, _layout in four_ranks:
        assert counts["usp"] == {"all_to_all_single": 4, "counter": {"all_to_all": 4, "ring_exchange": 1}}
        assert counts["ring4"] == {"ring_exchange": 3}
        assert counts["ring4_allgather"] == {"all_gather": 1, "equal": True}
        assert counts["usp_allgather"] == {"all_to_all": 4, "all_gather": 1, "equal": True}


def test_mesh_layout_and_errors(two_ranks, four_ranks):
    for rank, (_errors, counts) in enumerate(two_ranks):
        message = counts["mesh_error"]
        assert message is not None and "3 ranks" in message and "has 2" in message and "(1, 2, 1)" in message
        assert counts["mesh"] == {"ring": (0, 1, [rank]), "ulysses": (rank, 2, [0, 1]), "tp": (0, 1, [rank])}
    for rank, (_errors, _counts, layout) in enumerate(four_ranks):
        ring_rank, ulysses_rank = divmod(rank, 2)  # ulysses innermost
        expected_ring = [ulysses_rank, ulysses_rank + 2]
        expected_ulysses = [2 * ring_rank, 2 * ring_rank + 1]
        assert layout["ring"] == (ring_rank, expected_ring, ring_rank, expected_ring)
        assert layout["ulysses"] == (ulysses_rank, expected_ulysses, ulysses_rank, expected_ulysses)


def test_mesh_needs_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(MeshError, match="init_process_group"):
        ParallelMesh({"ulysses": 2})
    with pytest.raises(MeshError, match="unique"):
        ParallelMesh([("a", 1), ("a", 1)])
    assert factorisations(4, 2) == [(1, 4), (2, 2), (4, 1)]


def test_even_shard_sizes_and_local_lse():
    assert even_shard_sizes(13, 4) == (4, 3, 3, 3)
    assert even_shard_sizes(12, 2) == (6, 6)
    q, k, v = _inputs(1, 2, 5, 8, seed=3)
    mask = _dense_mask(1, 5, seed=1)
    for m in (None, mask):
        out, lse = attention_with_lse(q, k, v, attn_mask=m)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        assert _max_rel(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m)) <= TOL
        assert _max_rel(lse, torch.logsumexp(scores, -1)) <= TOL


def _raise_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 blocks here until the driver kills it
    return rank


def _hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(600)
    return torch.full((2,), float(rank))


@pytest.mark.ends_rank_pools
def test_harness_reports_rank_traceback():
    with pytest.raises(RankFailedError, match="rank 1 of 2 raised") as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert "deliberate failure on rank one" in info.value.rank_traceback
    assert "_raise_on_rank_one" in info.value.rank_traceback
    assert not multiprocessing.active_children()


def _ready(rank, world):
    return rank


@pytest.mark.ends_rank_pools
def test_harness_times_out_on_hang():
    # the ranks started first (the test before ended the pool): the 5 s below time the hang alone, not a start-up
    # that a busy machine can stretch past them (rank 0 would then be pending too); in a started pool rank 0 only
    # unpickles the call and returns a 2-element tensor, well within 5 s on a loaded machine
    assert run_ranks(_ready, 2) == [0, 1]
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[1\] did not finish") as info:
        run_ranks(_hang_on_rank_one, 2, timeout=5)
    assert info.value.pending_ranks == [1]
    # well under the hung rank's 600 s; the slack covers a loaded 2-core machine
    assert time.monotonic() - start < 5 + 60
    assert not multiprocessing.active_children()


def test_harness_rejects_local_function():
    def local(rank, world):
        return rank

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local, 2)


def test_fp8_rows_round_trip_and_bytes():
    """The float8 all-to-all payload: D e4m3 bytes + the row's fp32 scale; each value within 2**-4 of its row's
    largest, zero rows exactly zero, the dtype restored."""
    from dit_passes.parallel.attention import fp8_rows, from_fp8_rows
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 1e3]).view(1, 3, 1)
    x[0, 0] = 0
    for dtype in (torch.float32, torch.bfloat16):
        payload = fp8_rows(x.to(dtype))
        assert payload.dtype == torch.uint8 and payload.shape == (5, 3, 16 + 4)
        back = from_fp8_rows(payload, dtype)
        assert back.dtype == dtype and torch.equal(back[0, 0].float(), torch.zeros(16))
        err = (back.float() - x.to(dtype).float()).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        assert err.max() <= 2 ** -4, err.max()


def test_parallelism_config_maps_rotate_method_and_float8():
    from dit_passes import ParallelismConfig
    (ring,) = ParallelismConfig(ring_size=2, ring_rotate_method="allgather").to_passes()
    assert ring.attention_op == "ring_allgather_attention"
    (ulysses,) = ParallelismConfig(ulysses_size=2, ulysses_float8=True).to_passes()
    assert ulysses.attention_op == "ulysses_fp8_attention"
    (plain,) = ParallelismConfig(ulysses_size=2).to_passes()
    assert plain.attention_op == "ulysses_attention"
    with pytest.raises(ValueError, match="'p2p' .*'allgather'"):
        ParallelismConfig(ring_size=2, ring_rotate_method="ring").to_passes()
