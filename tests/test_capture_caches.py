"""Function caches (``functools.lru_cache`` on a method) that a trace would fill with fake tensors: capture empties
the ones that missed during an export, so a fresh model captures and still runs eagerly afterwards (NucleusMoE's
RoPE table; ``dit_passes.capture_caches``); likewise an attribute a lazy forward adds or sets while traced."""
from __future__ import annotations

import functools

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.capture import capture
from dit_passes.capture_caches import function_caches


class _CachedTable(torch.nn.Module):
    """A table memoised per length on the class (keyed by ``self``), like a RoPE table keyed on the image grid;
    ``routed`` adds a host read of constant counts (``torch.full(...).tolist()``), which makes the first export
    fail on data-dependent sizes and capture retry after an eager run."""

    def __init__(self, routed: bool):
        super().__init__()
        self.routed = routed
        self.proj = torch.nn.Linear(8, 8)

    @functools.lru_cache(maxsize=8)
    def table(self, n: int) -> torch.Tensor:
        return torch.polar(torch.ones(n, 4), torch.arange(n * 4.0).reshape(n, 4) / 7)

    def forward(self, x):
        rotated = torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], 4, 2)) * self.table(x.shape[1]))
        y = self.proj(rotated.flatten(-2))
        if self.routed:
            sizes = torch.full((2,), x.shape[1], dtype=torch.long).tolist()
            y = torch.cat([y[:, :sizes[0]], y[:, :sizes[1]] * 2], dim=1)
        return (y,)


@pytest.mark.parametrize("routed", [False, True])
def test_fresh_model_with_a_method_cache_captures_and_still_runs_eagerly(routed):
    torch.manual_seed(0)
    model = _CachedTable(routed).eval()
    assert type(model).table in function_caches(model)
    type(model).table.cache_clear()  # fresh, whatever another test left there
    x = torch.randn(2, 5, 8)
    captured = capture(model, (), {"x": x})
    with torch.no_grad():
        ref = model(x)[0]  # eager after the capture: a fake table left in the cache fails here
        out = captured.gm(x)[0]
    assert bool(captured.baked_scalars) == routed
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


class _LazyTable(torch.nn.Module):
    """A table added as an attribute by the first call (not declared in ``__init__``): export leaves a FakeTensor
    there unless capture drops it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.arange(x.shape[1] * 8.0).reshape(x.shape[1], 8) / 7
        return (self.proj(x * self.table),)


def test_attribute_a_lazy_forward_adds_while_traced_is_dropped():
    torch.manual_seed(0)
    model = _LazyTable().eval()
    x = torch.randn(2, 5, 8)
    captured = capture(model, (), {"x": x})
    assert not hasattr(model, "table")  # as fresh as before the capture
    with torch.no_grad():
        ref = model(x)[0]
        out = captured.gm(x)[0]
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    captured = capture(model, (), {"x": x})  # an attribute from an eager call stays: the graph bakes it
    assert isinstance(model.table, torch.Tensor) and torch.equal(captured.gm(x)[0], out)


class _DeclaredTable(torch.nn.Module):
    """A table declared ``None`` in ``__init__`` and set by the first call to a list of complex tables (Bria-FIBO 2's
    ``freqs_cis``), with a host read that makes the first export fail and capture retry after an eager run."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.tables = None

    def forward(self, x):
        if self.tables is None:
            self.tables = [torch.polar(torch.ones(x.shape[1], 4), torch.arange(x.shape[1] * 4.0).reshape(-1, 4) / 7)]
        y = self.proj(torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], 4, 2)) * self.tables[0])
                      .flatten(-2))
        n = int(torch.full((1,), x.shape[1]).item())
        return (y[:, :n],)


def test_attribute_declared_then_set_while_traced_gets_its_value_back():
    torch.manual_seed(0)
    model = _DeclaredTable().eval()
    x = torch.randn(2, 5, 8)
    captured = capture(model, (), {"x": x})  # no eager call before: the first export sets the fake list
    assert captured.baked_scalars
    with torch.no_grad():
        ref = model(x)[0]
        out = captured.gm(x)[0]
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_fresh_nucleusmoe_captures_and_equals_eager_under_dbcache():
    """NucleusMoE memoises its RoPE table with ``lru_cache`` and reads its expert sizes on the host: a fresh model
    captured only after an eager call, before capture emptied the caches its first export filled. The computed
    call is the whole captured graph (vs eager), the cached one reuses its residual (same inputs: same output)."""
    import diffusers

    from dit_passes.models import zoo

    if not hasattr(diffusers, zoo.class_name_of("nucleusmoe")):
        pytest.skip("this diffusers has no NucleusMoE transformer")
    zm = zoo.build("nucleusmoe")
    kw = zm.make_inputs(batch=1, seed=1)
    for cache in function_caches(zm.model):  # fresh: no entry of another instance / test can hide the problem
        cache.cache_clear()
    always = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, enable_separate_cfg=False,
                  max_warmup_steps=1)
    cached = compile_dit(zm.model, passes=[passes.DBCache(**always)], example_inputs=kw)  # no eager call before
    with torch.no_grad():
        ref = zm.model(**kw)[0]  # eagerly after the capture: no fake tensor left in the model's caches
        outs = [cached(**kw)[0] for _ in range(2)]
    assert list(cached.report("dbcache").last_generation()["step_cached"]) == [False, True]
    scale = ref.abs().max()
    for out in outs:
        assert (out - ref).abs().max() <= 1e-5 * scale


def test_fresh_bria_fibo2_captures_and_equals_eager():
    """Bria-FIBO 2 keeps its RoPE tables on a plain ``RopeEmbedder`` object (``freqs_cis = None``, then set by the
    first call) and reads a gist count on the host: a fresh model captured only after an eager call, before capture
    put back the attributes its first export set to fake tables on the objects the modules hold."""
    import diffusers

    from dit_passes.models import zoo

    if not hasattr(diffusers, zoo.class_name_of("bria_fibo2")):
        pytest.skip("this diffusers has no Bria-FIBO 2 transformer")
    zm = zoo.build("bria_fibo2")
    kw = zm.make_inputs(batch=1, seed=1)
    compiled = compile_dit(zm.model, passes=[], example_inputs=kw)  # no eager call before
    with torch.no_grad():
        ref = zm.model(**kw)[0]  # eagerly after the capture: no fake table left on the model's objects
        out = compiled(**kw)[0]
    assert torch.equal(out, ref)
