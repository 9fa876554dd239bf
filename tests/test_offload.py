"""LayerwiseOffload on CPU: outputs unchanged, the transfer schedule (which load sits before which block),
the loaded bytes alive at any point of the graph bounded as configured, persistent blocks, and the
composition with DBCache: a cached step loads only the Fn / Bn blocks' weights.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.offload import parse_bytes, persistent_blocks
from dit_passes.testing.counting import OpCounter

ONLOAD = torch.ops.dit_passes.onload.default


def _loads(gm):
    return [n for n in gm.graph.nodes if n.target is ONLOAD]


def _block_of_first_user(gm, load, structure):
    """Index of the block whose nodes first follow the load in graph order (where the load was issued)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min((b for b in structure.blocks if order[b.first] > order[load]), key=lambda b: order[b.first]).index


def _peak_loaded_bytes(gm):
    """Max over graph positions of the bytes of onloaded copies alive (from the load to its last reader)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    spans = []
    for load in _loads(gm):
        for item in load.users:
            v = item.meta["val"]
            end = max((pos[u] for u in item.users), default=pos[item])
            spans.append((pos[load], end, v.numel() * v.element_size()))
    return max(sum(b for s, e, b in spans if s <= i <= e) for i in range(len(nodes)))


def _block_bytes(model, index_paths):
    return {p: sum(t.numel() * t.element_size() for t in model.get_submodule(p).parameters()) for p in index_paths}


@pytest.fixture()
def flux():
    zm = build("flux")
    return zm, zm.make_inputs()


def test_sync_offload_loads_each_block_as_it_starts(flux):
    zm, kw = flux
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    c = compile_dit(zm.model, passes=[passes.LayerwiseOffload(onload_device="cpu")], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], ref)
    s, gm = c.structure, c.graph_module
    loads = _loads(gm)
    assert len(loads) == len(s.blocks) == 4
    assert [int(n.name.rsplit("_", 1)[1]) for n in loads] == [_block_of_first_user(gm, n, s) for n in loads]
    biggest = max(_block_bytes(zm.model, [b.path for b in s.blocks]).values())
    assert _peak_loaded_bytes(gm) <= biggest  # one block's weights at a time
    rec = [r for r in c._current().manager.records if r.name == "layerwise_offload"][0].result.counts
    assert rec["blocks_offloaded"] == 4 and rec["prefetched_ahead"] == 0 and "onload_block_0" in c.code


def test_async_prefetch_distance_byte_cap_and_persistent_blocks(flux):
    zm, kw = flux
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    c = compile_dit(zm.model, passes=[passes.LayerwiseOffload(onload_device="cpu", async_transfer=True,
                                                              transfer_buckets=2)], example_inputs=kw)
    s, gm = c.structure, c.graph_module
    issued = {int(n.name.rsplit("_", 1)[1]): _block_of_first_user(gm, n, s) for n in _loads(gm)}
    assert issued == {0: 0, 1: 0, 2: 0, 3: 1}  # two blocks ahead, never before block 0
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], ref)
    sizes = sorted(_block_bytes(zm.model, [b.path for b in s.blocks]).values())
    assert _peak_loaded_bytes(gm) <= sum(sizes[-3:])  # the running block + two ahead

    # a byte budget of the biggest block: the biggest blocks load at most one block ahead, and what is
    # loaded ahead never exceeds the budget beside the running block
    one = max(sizes)
    capped = compile_dit(zm.model, passes=[passes.LayerwiseOffload(onload_device="cpu", async_transfer=True,
                                                                   transfer_buckets=2,
                                                                   max_inflight_prefetch_bytes=one)], example_inputs=kw)
    issued = {int(n.name.rsplit("_", 1)[1]): _block_of_first_user(capped.graph_module, n, capped.structure)
              for n in _loads(capped.graph_module)}
    by_size = _block_bytes(zm.model, [b.path for b in capped.structure.blocks])
    big = [b.index for b in capped.structure.blocks if by_size[b.path] == one]
    assert big and all(b - issued[b] <= 1 for b in big), issued
    assert _peak_loaded_bytes(capped.graph_module) <= one + one

    kept = compile_dit(zm.model, passes=[passes.LayerwiseOffload(onload_device="cpu", persistent_buckets=2,
                                                                 persistent_bins=2)], example_inputs=kw)
    assert sorted(int(n.name.rsplit("_", 1)[1]) for n in _loads(kept.graph_module)) == [1, 3]  # 0 and 2 stay


def test_with_dbcache_cached_steps_load_only_fn_and_bn_blocks(flux):
    zm, kw = flux
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=2)
    plain = compile_dit(zm.model, passes=[passes.DBCache(**cfg)])
    both = compile_dit(zm.model, passes=[passes.LayerwiseOffload(onload_device="cpu", async_transfer=True),
                                         passes.DBCache(**cfg)])
    both.lower(**kw)  # lowering runs the branches on fake tensors: keep it out of the count
    per_step = []
    for i in range(5):
        k = dict(kw, timestep=torch.full_like(kw["timestep"], 1.0 - i / 5))
        with torch.no_grad():
            ref = plain(**k)[0]
            counter = OpCounter(["dit_passes.onload"])
            with counter:
                out = both(**k)[0]
        assert torch.equal(out, ref), f"step {i}"
        per_step.append(counter.counts["dit_passes.onload"])
    # warm-up steps 0, 1 compute all 4 blocks; steps 2-4 are cached: only block 0 (Fn) and block 3 (Bn) load
    assert per_step == [4, 4, 2, 2, 2], per_step
    assert both.cache_summary(as_dict=True)[-1]["cached_steps"] == [2, 3, 4]
    branch_loads = _loads(both.graph_module.dbcache_compute)
    assert sorted(n.name for n in branch_loads) == ["onload_block_1", "onload_block_2"]


def test_options_and_errors():
    assert parse_bytes("8gib") == 8 * 2 ** 30 and parse_bytes("512MB") == 512 * 10 ** 6 and parse_bytes(7) == 7
    assert persistent_blocks(8, 4, 2) == [0, 1, 4, 5] and persistent_blocks(8, 2, 1) == [0, 1]
    with pytest.raises(ValueError, match="max_inflight_prefetch_bytes"):
        passes.LayerwiseOffload(max_inflight_prefetch_bytes="lots")
    with pytest.raises(ValueError, match="transfer_buckets"):
        passes.LayerwiseOffload(transfer_buckets=-1)


@pytest.mark.parity("layerwise_offload", "layerwise_cpu_offload")
def test_front_end_layerwise_offload_composes_with_enable_cache():
    import dit_passes as cache_dit
    from dit_passes.testing.pipelines import flux_pipeline

    def run(pipe):
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            return pipe(prompt_embeds=torch.randn(1, 7, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                        height=16, width=16, num_inference_steps=6, guidance_scale=3.5, output_type="latent",
                        generator=torch.Generator().manual_seed(3)).images

    cfg = cache_dit.DBCacheConfig(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=2)
    plain = flux_pipeline(build("flux").model)
    cache_dit.enable_cache(plain, cache_config=cfg)
    ref = run(plain)
    pipe = flux_pipeline(build("flux").model)
    cache_dit.enable_cache(pipe, cache_config=cfg)
    cache_dit.layerwise_offload(pipe, onload_device="cpu", offload_device="cpu", async_transfer=True,
                                transfer_buckets=1, persistent_buckets=1)
    out = run(pipe)
    assert torch.equal(out, ref)
    names = [p.name for p in pipe.transformer.passes]
    assert names == ["dbcache", "layerwise_offload"]  # the PassManager runs offload first
    ran = [r.name for r in pipe.transformer._current().manager.records]
    assert ran.index("layerwise_offload") < ran.index("dbcache")
    assert cache_dit.summary(pipe, logging=False)[0].cached_steps == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="already offloaded"):
        cache_dit.layerwise_offload(pipe, onload_device="cpu")
    # cache-dit's layerwise_cpu_offload: the same with the weights kept in host memory
    pipe = flux_pipeline(build("flux").model)
    cache_dit.enable_cache(pipe, cache_config=cfg)
    cache_dit.layerwise_cpu_offload(pipe, onload_device="cpu")
    assert torch.equal(run(pipe), ref)
    offload = pipe.transformer.passes[-1]
    assert offload.name == "layerwise_offload" and str(offload.offload_device) == "cpu"
    with pytest.raises(TypeError, match="keeps the weights on the CPU"):
        cache_dit.layerwise_cpu_offload(flux_pipeline(build("flux").model), offload_device="cuda")


@pytest.mark.parity("get_layerwise_offload_handles", "remove_layerwise_offload", "LayerwiseOffloadHandleGroup")
@pytest.mark.parity("LayerwiseOffloadHandle", status="partial")  # built over the wrapper's pass, not hooks
def test_offload_handles_found_and_removed_as_cache_dits():
    # cache-dit's own offload pins host memory (CUDA only): its handles are compared where they run on a CPU
    # (the group over our handles, the answers for a module never offloaded); the counts follow its contract
    import dit_passes as dp
    cache_dit = pytest.importorskip("cache_dit")
    zm = build("flux")
    kw = zm.make_inputs()
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    plain = build("flux").model
    assert dp.get_layerwise_offload_handles(plain) == () == cache_dit.get_layerwise_offload_handles(plain)
    assert dp.remove_layerwise_offload(plain) == 0 == cache_dit.remove_layerwise_offload(plain)
    wrapper = dp.layerwise_offload(zm.model, onload_device="cpu", persistent_buckets=1)
    with torch.no_grad():
        assert torch.equal(wrapper(**kw)[0], ref)
    (ours,) = dp.get_layerwise_offload_handles(wrapper)
    assert dp.get_layerwise_offload_handles(wrapper) == (ours,)  # one pass, one handle, as cache-dit's registry
    assert isinstance(ours, dp.LayerwiseOffloadHandle) and str(ours.offload_device) == "cpu"
    assert ours.module_names == [f"{n}.{i}" for n, m in zm.model.named_children()
                                 if isinstance(m, torch.nn.ModuleList) for i in range(len(m))]
    # the group aggregates as cache-dit's does, over the same handles
    for roots in (["transformer"], [""]):
        mine = dp.LayerwiseOffloadHandleGroup(source=wrapper, handles=[ours], root_names=roots)
        theirs = cache_dit.LayerwiseOffloadHandleGroup(source=wrapper, handles=[ours], root_names=roots)
        assert mine.module_names == theirs.module_names and len(mine) == len(theirs) == 1
        assert list(mine) == list(theirs) == [ours]
    # removal: how many, then none left; the module then runs without the pass
    assert (dp.remove_layerwise_offload(wrapper), dp.remove_layerwise_offload(wrapper)) == (1, 0)
    assert dp.get_layerwise_offload_handles(wrapper) == () and not wrapper.passes and ours.removed
    with torch.no_grad():
        assert torch.equal(wrapper(**kw)[0], ref)
    with pytest.raises(ValueError, match="get_layerwise_offload_handles"):
        dp.LayerwiseOffloadHandle(wrapper, passes.LayerwiseOffload())
