"""Reuse of captured graphs across instances of one architecture (dit_passes.infra.trace_templates.py).

A reused graph must be the graph a fresh capture of the new model gives: same code, same parameters and buffers
(the new model's own tensors, persistence kept), same output, and nothing of the model it was first traced from;
anything that can change the trace (config, processor, mode, hooks, call, mask values) must miss. The same holds
for a graph another process stored (DIT_PASSES_TRACE_DIR): loaded, it is the fresh capture node for node, meta
included; a key that is not the same in another process is not shared.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from dit_passes.capture import ValueSpecializationError, capture
from dit_passes.infra.trace_store import TraceStore, shared_name
from dit_passes.infra.trace_templates import TraceTemplates, module_fingerprint
from dit_passes.infra.facts import facts_of
from dit_passes.models.zoo import build


def _flat(inputs):
    leaves, _ = pytree.tree_flatten({k: v for k, v in inputs.items() if k != "return_dict"})
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _sample(out):
    return pytree.tree_flatten(out)[0][0]


def _perturbed(family, **overrides):
    """A second instance of the family's architecture with other weights (every tensor of it differs)."""
    zm = build(family, seed=3, **overrides)
    with torch.no_grad():
        for t in list(zm.model.parameters()) + [b for b in zm.model.buffers() if b.is_floating_point()]:
            t.add_(0.01)
    return zm


# wan reads a weight through ``param.to(device)`` in forward, which export lifts as a constant aliasing it;
# zimage's graph holds a higher-order op's body (autocast) as a submodule
@pytest.mark.parametrize("family", ["flux", "wan", "zimage"])
def test_reused_graph_is_the_fresh_capture_of_the_new_model(family):
    templates = TraceTemplates()
    first = build(family)
    inputs = first.make_inputs(batch=2, seed=1)
    capture(first.model, (), inputs, templates=templates)
    assert (templates.hits, templates.misses) == (0, 1)
    first_storages = {t.untyped_storage().data_ptr() for t in first.model.state_dict().values()}
    second = _perturbed(family)
    reused = capture(second.model, (), inputs, templates=templates)
    assert (templates.hits, templates.misses) == (1, 1)
    fresh = capture(second.model, (), inputs)
    assert reused.gm.code == fresh.gm.code
    assert dict(reused.gm.named_parameters()).keys() == dict(fresh.gm.named_parameters()).keys()
    assert reused.gm.state_dict().keys() == fresh.gm.state_dict().keys()  # persistent buffers alike
    assert dict(reused.gm.named_buffers()).keys() == dict(fresh.gm.named_buffers()).keys()
    for name, p in reused.gm.named_parameters():
        assert p is second.model.get_parameter(name), name  # the new model's own tensors, no copy
    assert not first_storages & {t.untyped_storage().data_ptr() for t in reused.gm.state_dict().values()}
    with torch.no_grad():
        expected = _sample(second.model(**inputs))  # zimage returns a list of samples
        assert torch.equal(reused.gm(*_flat(inputs))[0], expected)
        assert torch.equal(fresh.gm(*_flat(inputs))[0], expected)
        assert not torch.equal(_sample(first.model(**inputs)), expected)  # the check above could fail


def test_templates_hold_no_weight_of_the_traced_model():
    templates = TraceTemplates()
    zm = build("flux")
    inputs = zm.make_inputs(batch=1, seed=1)
    capture(zm.model, (), inputs, templates=templates)
    watched = weakref.ref(next(zm.model.parameters()))
    del zm
    gc.collect()
    assert watched() is None, "a template keeps a weight of the model it was traced from"


def test_anything_that_changes_the_trace_misses():
    base = build("flux")
    inputs = base.make_inputs(batch=1, seed=1)
    key = module_fingerprint(base.model)
    assert module_fingerprint(build("flux", seed=5).model) == key  # other weights: same architecture
    assert module_fingerprint(build("flux", num_layers=3).model) != key
    trained = build("flux")
    trained.model.train()
    assert module_fingerprint(trained.model) != key
    hooked = build("flux")
    hooked.model.transformer_blocks[0].register_forward_hook(lambda m, a, out: out)
    assert module_fingerprint(hooked.model) != key
    processor = build("flux")
    attn = processor.model.transformer_blocks[0].attn
    attn.set_processor(type(attn.processor)())
    assert module_fingerprint(processor.model) == key  # an equal processor object
    attn.processor.extra_option = 2  # an attribute a processor's __call__ could read
    assert module_fingerprint(processor.model) != key
    templates = TraceTemplates()
    capture(base.model, (), inputs, templates=templates)
    capture(build("flux").model, (), base.make_inputs(batch=2, seed=1), templates=templates)  # other call
    assert (templates.hits, templates.misses) == (0, 2)


class _Masked(torch.nn.Module):
    """Keeps the tokens its mask selects (a data-dependent size): captured specialised on the mask's values."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, mask):
        keep = mask[0] != 0
        x = self.proj(hidden_states[:, keep]).tanh()
        return (hidden_states.masked_scatter(keep[None, :, None].expand_as(hidden_states), x),)


def test_value_specialised_graphs_are_keyed_by_the_mask_values():
    templates = TraceTemplates()
    x = torch.randn(1, 6, 8)
    mask_a = torch.tensor([[1, 1, 1, 0, 0, 0]])
    mask_b = torch.tensor([[1, 1, 1, 1, 1, 0]])
    torch.manual_seed(0)
    first, second = _Masked(), _Masked()
    capture(first, (), {"hidden_states": x, "mask": mask_a}, templates=templates)
    reused = capture(second, (), {"hidden_states": x, "mask": mask_a}, templates=templates)
    assert (templates.hits, templates.misses) == (1, 1) and reused.baked_scalars
    with torch.no_grad():
        out = reused.gm(x, mask_a)
        assert torch.equal(out[0], second(x, mask_a)[0])
    capture(second, (), {"hidden_states": x, "mask": mask_b}, templates=templates)
    assert (templates.hits, templates.misses) == (1, 2)
    # the reused graph carries the run-time guard on the baked scalars, as a fresh capture does
    facts = facts_of(reused.gm)
    assert facts.num_user_outputs == 1 and len(facts.state_io) == 1
    facts.state_io[0].outputs(None, [out[-1]])
    with pytest.raises(ValueSpecializationError):
        facts.state_io[0].outputs(None, [out[-1] + 1])


# ---- the store shared between processes (dit_passes.infra.trace_store, DIT_PASSES_TRACE_DIR) ----

def _assert_same_graph(loaded, fresh):
    """Node for node: name, op, target, args and every meta entry a pass can read (fake values by metadata)."""
    assert loaded.code == fresh.code
    for a, b in zip(loaded.graph.nodes, fresh.graph.nodes, strict=True):
        assert (a.name, a.op, a.target, repr(a.args), repr(a.kwargs)) == (b.name, b.op, b.target, repr(b.args),
                                                                         repr(b.kwargs))
        assert a.meta.keys() == b.meta.keys(), a.name
        for key in a.meta.keys() - {"from_node"}:  # from_node: provenance by graph id, new in every capture
            va, vb = pytree.tree_flatten(a.meta[key])[0], pytree.tree_flatten(b.meta[key])[0]
            if key == "val":
                spec = lambda v: (type(v).__name__, tuple(v.shape), v.stride(), v.storage_offset(), v.dtype,  # noqa
                                  v.requires_grad) if isinstance(v, torch.Tensor) else v
                assert [spec(v) for v in va] == [spec(v) for v in vb], a.name
            else:
                assert repr(va) == repr(vb), (a.name, key)


@pytest.mark.parametrize("family", ["flux", "zimage"])  # zimage: a higher-order op's body
def test_stored_graph_loads_as_the_fresh_capture(family, tmp_path):
    first = build(family)
    inputs = first.make_inputs(batch=1, seed=1)
    writer = TraceTemplates(shared=TraceStore(str(tmp_path)))
    capture(first.model, (), inputs, templates=writer)
    assert writer.shared.writes == 1
    second = _perturbed(family)
    reader = TraceTemplates(shared=TraceStore(str(tmp_path)))  # nothing in memory: what another process sees
    loaded = capture(second.model, (), inputs, templates=reader)
    assert (reader.hits, reader.misses, reader.loaded, reader.shared.writes) == (1, 0, 1, 0)
    fresh = capture(second.model, (), inputs)
    _assert_same_graph(loaded.gm, fresh.gm)
    for name, sub in fresh.gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            _assert_same_graph(loaded.gm.get_submodule(name), sub)
    vals = [n.meta["val"] for n in loaded.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert detect_fake_mode(vals) is not None  # one fake mode, as passes expect (detect_fake_mode, from_tensor)
    for name, p in loaded.gm.named_parameters():
        assert p is second.model.get_parameter(name), name
    with torch.no_grad():
        assert torch.equal(loaded.gm(*_flat(inputs))[0], _sample(second.model(**inputs)))


def test_stored_value_specialised_graphs_keep_their_mask_values_and_guard(tmp_path):
    x = torch.randn(1, 6, 8)
    mask_a, mask_b = torch.tensor([[1, 1, 1, 0, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1, 0]])
    torch.manual_seed(0)
    first, second = _Masked(), _Masked()
    writer = TraceTemplates(shared=TraceStore(str(tmp_path)))
    capture(first, (), {"hidden_states": x, "mask": mask_a}, templates=writer)
    capture(first, (), {"hidden_states": x, "mask": mask_b}, templates=writer)
    assert writer.shared.writes == 2  # one file, both masks' graphs
    reader = TraceTemplates(shared=TraceStore(str(tmp_path)))
    loaded = capture(second, (), {"hidden_states": x, "mask": mask_b}, templates=reader)
    assert reader.loaded == 1 and loaded.baked_scalars == [5]
    with torch.no_grad():
        out = loaded.gm(x, mask_b)
        assert torch.equal(out[0], second(x, mask_b)[0])
    check = facts_of(loaded.gm).state_io[0].outputs
    check(None, [out[-1]])
    with pytest.raises(ValueSpecializationError):
        check(None, [out[-1] - 1])


def test_a_key_that_differs_between_processes_is_not_shared(tmp_path):
    hooked = build("flux")
    hooked.model.transformer_blocks[0].register_forward_hook(lambda m, a, out: out)  # keyed by the hook's id
    inputs = hooked.make_inputs(batch=1, seed=1)
    assert shared_name(TraceTemplates.key_of(hooked.model, ("call",))) is None
    assert shared_name(("opaque", repr(object()))) is None  # an address
    assert shared_name(TraceTemplates.key_of(build("flux").model, ("call",))) is not None
    templates = TraceTemplates(shared=TraceStore(str(tmp_path)))
    capture(hooked.model, (), inputs, templates=templates)
    assert templates.shared.writes == 0 and not any(p.suffix != ".lock" for p in tmp_path.iterdir())


_PROCESS = """
import json, sys, torch, torch.utils._pytree as pytree
from dit_passes.capture import capture
from dit_passes.infra.trace_templates import default_templates
from dit_passes.models.zoo import build
zm = build("flux", seed=int(sys.argv[1]))
inputs = zm.make_inputs(batch=1, seed=1)
templates = default_templates()
print("ready", flush=True)
sys.stdin.readline()  # the other process is ready too: both ask at once
got = capture(zm.model, (), inputs, templates=templates)
flat = [x for x in pytree.tree_flatten({k: v for k, v in inputs.items() if k != "return_dict"})[0]
        if isinstance(x, torch.Tensor)]
with torch.no_grad():
    same = torch.equal(got.gm(*flat)[0], zm.model(**inputs)[0])
print(json.dumps({"loaded": templates.loaded, "writes": templates.shared.writes, "same": same}))
"""


def test_processes_asking_at_once_capture_once(tmp_path):
    """Two processes (a child and this one, released together once both have built their model) ask an empty store
    at once: one captures (holding the key's lock), the other loads its file; a third reader (here) loads it too
    and gets the fresh capture's graph. This process is the second asker: one child's start-up, not two."""
    env = {**os.environ, "DIT_PASSES_REUSE_TRACES": "1", "DIT_PASSES_TRACE_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-P", "-c", _PROCESS, "1"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    mine = build("flux", seed=2)
    inputs = mine.make_inputs(batch=1, seed=1)
    templates = TraceTemplates(shared=TraceStore(str(tmp_path)))
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    got = capture(mine.model, (), inputs, templates=templates)
    with torch.no_grad():
        same = torch.equal(got.gm(*_flat(inputs))[0], _sample(mine.model(**inputs)))
    reports = [json.loads(child.communicate(timeout=600)[0].strip().splitlines()[-1]),
               {"loaded": templates.loaded, "writes": templates.shared.writes, "same": same}]
    assert child.returncode == 0
    assert sorted((r["loaded"], r["writes"]) for r in reports) == [(0, 1), (1, 0)], reports
    assert all(r["same"] for r in reports)
    third = build("flux", seed=3)
    inputs = third.make_inputs(batch=1, seed=1)
    reader = TraceTemplates(shared=TraceStore(str(tmp_path)))
    loaded = capture(third.model, (), inputs, templates=reader)
    assert reader.loaded == 1
    _assert_same_graph(loaded.gm, capture(third.model, (), inputs).gm)
