"""The step replayed as a CUDA graph (``torch_compile={"regional": True, "mode": "reduce-overhead"}``):
the same outputs and cache decisions as the eager step, over cache contexts, a new generation and a shape change,
and no host sync per step. The CPU tests check the warm-up mode (both arms of every cond run, the picked one is
returned) and the refusal where no CUDA graph can be replayed."""
import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.infra.cuda_graph_step import BothArms, CudaGraphUnavailable, IfNodeCapture, conditional_capture_mode
from dit_passes.models.zoo import build
from dit_passes.testing.counting import OpCounter

CUDA = torch.cuda.is_available()


def _conditional_nodes() -> str:
    """Why this torch cannot capture conditional nodes ("" when it can)."""
    try:
        conditional_capture_mode()
        return ""
    except CudaGraphUnavailable as e:
        return str(e)


WHY_NOT = _conditional_nodes() if CUDA else "no CUDA"
needs_cuda = pytest.mark.skipif(bool(WHY_NOT), reason=f"needs a CUDA graph with conditional nodes: {WHY_NOT[:120]}")


def _dbcache():
    # warm-up 1, then the threshold decides: some steps cached, some computed, on the timesteps below
    return passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1, residual_diff_threshold=0.45)


def _steps(n):
    return [1000.0 * (1 - i / (n + 1)) for i in range(n)]


def test_both_arms_runs_every_arm_and_returns_the_picked_one():
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=2)
    # lowered now (example_inputs): the counters below see the steps' ops only, not the capture's
    plain = compile_dit(zm.model, passes=[_dbcache()], keep_original=True, example_inputs=kw)
    warmed = compile_dit(zm.model, passes=[_dbcache()], keep_original=True, example_inputs=kw)
    full = None  # linears of a computed step (the first call computes: warm-up)
    with torch.no_grad():
        for t in _steps(4):
            call = dict(kw, timestep=torch.full_like(kw["timestep"], t))
            plain_linears = OpCounter(["addmm", "linear"])
            with plain_linears:
                ref = plain(**call)[0]
            full = full if full is not None else plain_linears.counts["addmm"] + plain_linears.counts["linear"]
            linears = OpCounter(["addmm", "linear"])
            with linears, BothArms() as mode:  # BothArms innermost: it sees the cond first
                out = warmed(**call)[0]
            assert mode.conds >= 1
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            # every block's linears ran, on cached steps too (the compute arm is warmed)
            assert linears.counts["addmm"] + linears.counts["linear"] == full
    assert warmed.cache_summary(as_dict=True)[-1]["cached_steps"] == plain.cache_summary(as_dict=True)[-1][
        "cached_steps"]
    assert plain.cache_summary(as_dict=True)[-1]["cached_steps"], "the schedule must cache some step"


def test_reduce_overhead_is_refused_on_cpu_before_capture():
    zm = build("flux")
    c = compile_dit(zm.model, passes=[_dbcache()],
                    torch_compile={"regional": True, "mode": "reduce-overhead", "backend": "eager"})
    with pytest.raises(CudaGraphUnavailable, match="reduce-overhead.*on cpu.*regional"):
        c(**zm.make_inputs(batch=1, seed=0))
    assert not c._by_key, "refused before capturing: no graph lowered"


# ------------------------------------------------------------------------------------------------- on a GPU
def _pair(backend="eager"):
    zm = build("flux")
    model = zm.model.cuda()
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in zm.make_inputs(batch=1, seed=2).items()}
    eager = compile_dit(model, passes=[_dbcache()], keep_original=True,
                        torch_compile={"regional": True, "backend": backend})
    graphed = compile_dit(model, passes=[_dbcache()], keep_original=True,
                          torch_compile={"regional": True, "backend": backend, "mode": "reduce-overhead"})
    return zm, kw, eager, graphed


def _run(module, kw, steps, context=None, no_sync_after=None):
    outs = []
    for i, t in enumerate(steps):
        call = dict(kw, timestep=torch.full_like(kw["timestep"], t))
        strict = no_sync_after is not None and i >= no_sync_after
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            if context is None:
                outs.append(module(**call)[0])
            else:
                with module.cache_context(context):
                    outs.append(module(**call)[0])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return outs


@needs_cuda
def test_graph_step_equals_eager_step_and_never_syncs():
    zm, kw, eager, graphed = _pair()
    steps = _steps(6)
    with torch.no_grad():
        ref = _run(eager, kw, steps)
        got = _run(graphed, kw, steps, no_sync_after=2)  # call 1 warms up, call 2 captures, then replays only
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    step = graphed._last.runner
    assert step.graph is not None and step.replays == len(steps) - 1
    g, e = graphed.cache_summary(as_dict=True)[-1], eager.cache_summary(as_dict=True)[-1]
    assert g["cached_steps"] == e["cached_steps"] and e["cached_steps"]


@needs_cuda
def test_graph_step_contexts_new_generation_and_shape_change():
    zm, kw, eager, graphed = _pair()
    steps = _steps(5)
    with torch.no_grad():
        for module in (eager, graphed):
            module.results = []
            for t in steps:  # a CFG pair per step: two contexts through one graph, each its own state
                for ctx in ("cond", "uncond"):
                    module.results += _run(module, dict(kw, hidden_states=kw["hidden_states"] * (2 if ctx == "cond"
                                                                                               else 1)), [t], ctx)
            module.new_generation()
            module.results += _run(module, kw, steps[:3])  # a generation stopped half way, then a new one
            module.results += _run(module, kw, steps)
            small = zm.make_inputs(batch=2, seed=3)  # another signature: its own capture
            small = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in small.items()}
            module.results += _run(module, small, steps[:4])
    assert len(graphed._by_key) == 2
    for a, b in zip(graphed.results, eager.results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@needs_cuda
def test_graph_step_with_inductor_regions():
    zm, kw, eager, graphed = _pair(backend="inductor")
    steps = _steps(5)
    with torch.no_grad():
        ref = _run(eager, kw, steps)
        got = _run(graphed, kw, steps, no_sync_after=2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert graphed._last.runner.replays == len(steps) - 1


@pytest.mark.skipif(not CUDA or not WHY_NOT, reason="needs a CUDA device whose torch has no conditional nodes")
def test_reduce_overhead_is_refused_before_capture_where_torch_has_no_conditional_nodes():
    zm = build("flux")
    model = zm.model.cuda()
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in zm.make_inputs(batch=1, seed=0).items()}
    c = compile_dit(model, passes=[_dbcache()], torch_compile={"regional": True, "mode": "reduce-overhead"})
    with pytest.raises(CudaGraphUnavailable, match="conditional nodes.*regional"):
        c(**kw)
    assert not c._by_key


@needs_cuda
def test_if_node_capture_replays_the_arm_the_device_picks():
    """IfNodeCapture (torch's IF-node calls where torch has them, else our ctypes ones: torch 2.11) on a cond with
    a nested cond in one arm: one capture, replayed with the predicates flipped on the device, no host read."""
    cond = torch.ops.higher_order.cond
    pred = torch.zeros((), dtype=torch.bool, device="cuda")
    inner = torch.zeros((), dtype=torch.int32, device="cuda")  # an integer predicate: nonzero is true
    x = torch.arange(4.0, device="cuda")

    def true_arm(i, a):
        (z,) = cond(i, lambda b: (b * 2 + 1,), lambda b: (b + 100,), (a,))
        return (z * 1,)

    def step(p, i, v):
        (y,) = cond(p, lambda a: true_arm(i, a), lambda a: (a - 3,), (v,))
        return y * 10

    with BothArms():
        step(pred, inner, x)  # warm every arm
    torch.cuda.synchronize()
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool), IfNodeCapture(pool):
        out = step(pred, inner, x)
    for flag, flag2 in ((True, 1), (False, 1), (True, 0), (False, 0), (True, 7)):
        pred.fill_(flag)
        inner.fill_(flag2)
        x.add_(1)
        want = ((x * 2 + 1 if flag2 else x + 100) if flag else x - 3) * 10
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(out, want)


# ------------------------------------------------------------------------------------------ our ctypes IF nodes
def test_if_node_ctypes_layout_matches_the_cuda_headers():
    """The ctypes mirror of cudaGraphNodeParams / cudaConditionalNodeParams against the sizes and offsets of the
    CUDA 12.4 and 13.0 headers (measured with gcc; a mismatch would corrupt the node the driver reads)."""
    from dit_passes.infra import cuda_if_node as m
    m._check_layout()
    assert m.GraphNodeParams.u.offset + m.ConditionalNodeParams.phGraph_out.offset == 32


def _nvrtc_missing() -> str:
    from dit_passes.infra import cuda_if_node as m
    try:
        m._nvrtc()
        return ""
    except m.CudaIfNodeError as e:
        return str(e)


@pytest.mark.skipif(bool(_nvrtc_missing()), reason="needs NVRTC (torch's CUDA wheels); no GPU needed")
def test_if_node_kernel_compiles_with_nvrtc():
    from dit_passes.infra import cuda_if_node as m
    cubin = m.compile_kernel("sm_90")
    assert cubin[:4] == b"\x7fELF" and m.KERNEL.encode() in cubin and b"cudaGraphSetConditional" in cubin
    assert b".entry " + m.KERNEL.encode() in m.compile_kernel("sm_90", ptx=True)


@needs_cuda
def test_if_node_refuses_a_float_predicate_and_a_stream_not_capturing():
    from dit_passes.infra import cuda_if_node as m
    from dit_passes.infra.cuda_graph_step import torch_has_if_nodes
    if torch_has_if_nodes():
        pytest.skip("torch has its own IF-node calls: ours are not used")
    ours = m.IfNodeCapturer(torch.cuda.graph_pool_handle())
    with pytest.raises(m.CudaIfNodeError, match="bool / integer"):
        ours.begin_capture_to_if_node(torch.ones((), device="cuda"))
    with pytest.raises(m.CudaIfNodeError, match="not capturing"):
        ours.begin_capture_to_if_node(torch.ones((), dtype=torch.bool, device="cuda"))
