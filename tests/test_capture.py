"""Capture round trip on every zoo family, the graph contract, and errors for bad input.

Reference: the original model run eagerly on the same inputs. With ``passes=[]`` the captured graph
runs the same ATen ops in the same order, so the outputs must be bit-identical (max abs diff 0).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from dit_passes import CompiledDiT, NoRepeatedBlocksError, compile_dit
from dit_passes.capture import CaptureError, ValueSpecializationError, capture
from dit_passes.models.zoo import FAMILIES, build

from diffusers.models.modeling_outputs import Transformer2DModelOutput

aten = torch.ops.aten


def _leaves(out):
    if isinstance(out, Transformer2DModelOutput):
        out = out.sample
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def assert_same(out, ref):
    a, b = _leaves(out), _leaves(ref)
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert torch.equal(x, y), f"max abs diff {(x - y).abs().max().item()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_exact_every_family(family):
    zm = build(family)
    inputs = zm.make_inputs()
    assert inputs.get("return_dict") is False
    compiled = compile_dit(zm.model)
    with torch.no_grad():
        ref = zm.model(**inputs)
        out = compiled(**inputs)
    assert type(out) is tuple and type(ref) is tuple
    assert_same(out, ref)
    # return_dict=True: the diffusers output class, same tensors, same graph
    with torch.no_grad():
        out_dict = compiled(**{**inputs, "return_dict": True})
    assert isinstance(out_dict, Transformer2DModelOutput)
    assert_same(out_dict, ref)
    assert len(compiled.graphs) == 1
    _check_graph_contract(compiled, zm.model, zm.expected["block_lists"])


def _check_graph_contract(compiled: CompiledDiT, model: torch.nn.Module, block_lists: dict) -> None:
    gm = compiled.graph_module
    params = dict(model.named_parameters())
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert "val" in n.meta and "dit_module_path" in n.meta, n.format_node()
            assert n.target is not aten._assert_tensor_metadata.default
            schema = getattr(n.target, "_schema", None)
            assert schema is None or not schema.is_mutable, f"in-place op left: {n.format_node()}"
        if n.op == "get_attr" and n.target in params:
            # parameters are the module's own tensors, under their original paths (no copy)
            assert gm.get_parameter(n.target) is params[n.target]
    paths = {n.meta["dit_module_path"] for n in gm.graph.nodes if n.op == "call_function"}
    for name, count in block_lists.items():  # module paths name the blocks, e.g. transformer_blocks.1.attn
        assert any(p.startswith(f"{name}.{count - 1}.") for p in paths), name
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == compiled._current().captured.input_names


def test_lumina2_cfg_batch_and_mask_values_key_the_graph():
    """Lumina2 reads its mask with ``tolist()``: its graph is specialised on the mask's values, so a CFG
    batch with a padded row and one with a full mask (same shapes) get a graph each, and both are exact.
    (Resolutions / batch / text length on a shape-only model: tests/test_compiled_pipeline.py.) One layer of each
    kind: the mask is read before the layers, and each of its graphs costs a capture."""
    zm = build("lumina2", num_layers=1, num_refiner_layers=1)
    compiled = compile_dit(zm.model)
    padded = zm.make_inputs(batch=2)
    assert not bool(padded["encoder_attention_mask"].all())
    full = {**padded, "encoder_attention_mask": torch.ones_like(padded["encoder_attention_mask"])}
    again = zm.make_inputs(batch=2, seed=1)  # same padding pattern as `padded`, other values
    with torch.no_grad():
        for inputs in (padded, full, again):
            assert_same(compiled(**inputs), zm.model(**inputs))
    assert len(compiled.graphs) == 2
    assert all(lg.captured.value_leaves for lg in compiled._by_key.values())


class _Block(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


class SignBranchDiT(torch.nn.Module):
    """Python control flow on a float-derived scalar: capture must specialise and guard it."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, hidden_states):
        x = hidden_states if bool((hidden_states.sum() > 0).item()) else -hidden_states
        for blk in self.blocks:
            x = blk(x)
        return (x,)


def test_float_dependent_scalar_is_guarded():
    torch.manual_seed(0)
    model = SignBranchDiT().eval()
    x = torch.randn(1, 4, 16)
    x = x if x.sum() > 0 else -x
    compiled = compile_dit(model)
    with torch.no_grad():
        assert_same(compiled(hidden_states=x), model(hidden_states=x))
        with pytest.raises(ValueSpecializationError, match="specialised on data-dependent scalars"):
            compiled(hidden_states=-x)  # same signature, the branch would flip


# -- bad input ----------------------------------------------------------------------------------
def test_not_a_dit_names_what_was_found():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with pytest.raises(NoRepeatedBlocksError, match=r"no repeated block list.*Top-level modules seen: \['0', '1', '2'\]"):
        compile_dit(mlp)(torch.randn(2, 8))


def test_wrong_keyword_names_forward_signature():
    zm = build("flux")
    inputs = zm.make_inputs()
    inputs["hidden_state"] = inputs.pop("hidden_states")
    with pytest.raises(TypeError, match=r"FluxTransformer2DModel\.forward\(hidden_states: .* does not accept this call"):
        compile_dit(zm.model)(**inputs)


def test_non_pass_is_type_error():
    zm = build("flux")
    with pytest.raises(TypeError, match="must hold dit_passes Pass instances, got str"):
        compile_dit(zm.model, passes=["cleanup"])
    with pytest.raises(TypeError, match="expects an nn.Module"):
        compile_dit(lambda x: x)


def test_untraceable_model_is_capture_error():
    class NoTensors(torch.nn.Module):
        def forward(self, n: int = 3):
            return (torch.zeros(n),)

    with pytest.raises(CaptureError, match="no tensor arguments"):
        capture(NoTensors(), (), {"n": 3})


def test_example_inputs_capture_eagerly_and_explain():
    zm = build("flux")
    compiled = compile_dit(zm.model, example_inputs=zm.make_inputs())
    assert len(compiled.graphs) == 1  # captured before any call
    text = compiled.explain(print_output=False)
    assert "captured FluxTransformer2DModel" in text and "== cleanup()" in text
    assert "transformer_blocks x2" in text and "single_transformer_blocks x2" in text


def test_module_without_input_guards_is_the_same_graph():
    # capture takes ep.module(check_guards=False) where torch has it: no guard function to generate and no extra
    # recompile, and once export's input checks are dropped (_flatten_codegen) the same graph, names, code and meta
    import inspect

    from dit_passes.capture import _flatten_codegen, _unlifted_module
    zm = build("flux")
    kw = {k: v for k, v in zm.make_inputs().items() if k != "return_dict"}

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = zm.model

        def forward(self, *args):
            return self.model(**dict(zip(kw, args)), return_dict=False)

    with torch.no_grad():
        ep = torch.export.export(Call(), tuple(kw.values()), strict=False)
    if "check_guards" not in inspect.signature(ep.module).parameters:
        pytest.skip("this torch's ExportedProgram.module() has no check_guards")
    guarded, unguarded = ep.module(), _unlifted_module(ep)
    assert any(n.target == "_guards_fn" for n in guarded.graph.nodes)
    assert not any(n.target == "_guards_fn" for n in unguarded.graph.nodes)
    for gm in (guarded, unguarded):
        _flatten_codegen(gm, list(kw))
    assert guarded.code == unguarded.code
    assert [(n.name, n.op, n.target, sorted(n.meta)) for n in guarded.graph.nodes] == \
        [(n.name, n.op, n.target, sorted(n.meta)) for n in unguarded.graph.nodes]
    with torch.no_grad():
        assert_same(unguarded(*kw.values()), guarded(*kw.values()))
