"""``QuantizeConfig.components_to_quantize`` with cache-dit 1.5.3's semantics, through ``enable_cache(pipe, ...)`` on a
tiny FluxPipeline with a CLIP ``text_encoder`` and a T5 ``text_encoder_2``: only the listed components are quantized,
each with its own config (list or dict form); ``"text_encoder"`` names the main (largest) encoder, ``text_encoder_2``
here, as the reference's ``parse_text_encoder``; a quantized text encoder stays within a bound of the unquantized one's
output; ``disable_cache`` puts every original back. The expected linears come from module names.
"""
from __future__ import annotations

import pytest
import torch

import dit_passes as cache_dit
from dit_passes.compiled import CompiledDiT
from test_frontend_parallel import _call  # the pipeline's images (6 steps, decoded)

def _pipeline():
    """test_frontend_parallel's tiny FluxPipeline (a T5 ``text_encoder_2``) with a CLIP ``text_encoder`` too."""
    import transformers as T
    from test_frontend_parallel import _pipeline as flux_with_t5

    pipe = flux_with_t5()
    clip = T.CLIPTextModel(T.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=16,
                                            bos_token_id=0, eos_token_id=2, pad_token_id=1)).eval()
    pipe.register_modules(text_encoder=clip)
    return pipe


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))


def _quantized(compiled):
    """{module path: kind} of the linears the passes replaced (a CompiledDiT's, or a graph's)."""
    gm = getattr(compiled, "graph_module", compiled)
    return {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in gm.graph.nodes
            if n.op == "call_function" and n.meta.get("dit_quant")}


def _linears(module, skip=()):
    return {p for p, m in module.named_modules() if isinstance(m, torch.nn.Linear) and not any(s in p for s in skip)}


def _encode(encoder, ids):
    with torch.no_grad():
        return encoder(input_ids=ids).last_hidden_state


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_list_quantizes_the_transformer_and_the_main_text_encoder(ids):
    pipe = _pipeline()
    t5, clip, transformer = pipe.text_encoder_2, pipe.text_encoder, pipe.transformer
    want = _encode(t5, ids)
    cache_dit.enable_cache(pipe, quantize_config=cache_dit.QuantizeConfig(
        quant_type="int8_per_row", components_to_quantize=["transformer", "text_encoder"]), keep_original=True)
    assert isinstance(pipe.text_encoder_2, CompiledDiT) and pipe.text_encoder is clip  # the reference's main encoder
    got = _encode(pipe.text_encoder_2, ids)
    # a text encoder has no _repeated_blocks: every linear but the default exclude_layers' substrings (none in T5)
    assert _quantized(pipe.text_encoder_2) == {p: "int8_per_row" for p in _linears(t5)}
    assert 0 < _rel(got, want) < 0.05, _rel(got, want)
    frontend = pipe.transformer.runtime.state["frontend"]  # its quantized linears: test_frontend_quant_rows.py
    assert [p.name for p in frontend.passes] == ["int8_linear"] and frontend.quantize_config.quant_type == "int8_per_row"
    assert pipe.transformer.runtime.state["frontend"].cache_config is None  # a quantize config alone: no cache
    cache_dit.disable_cache(pipe)
    assert pipe.text_encoder_2 is t5 and pipe.transformer is transformer and pipe.text_encoder is clip
    assert torch.equal(_encode(pipe.text_encoder_2, ids), want)


@pytest.mark.parity("QuantizeConfig.components_to_quantize")
def test_dict_gives_each_component_its_own_fields(ids):
    pipe = _pipeline()
    t5, clip = pipe.text_encoder_2, pipe.text_encoder
    want_t5, want_clip = _encode(t5, ids), _encode(clip, ids)
    cache_dit.enable_cache(pipe, quantize_config=cache_dit.QuantizeConfig(components_to_quantize={
        "transformer": {"quant_type": "float8_per_row"},
        "text_encoder_2": {"quant_type": "float8_per_tensor", "exclude_layers": ["DenseReluDense"]},
        clip: {"quant_type": "int8_per_row", "exclude_layers": []}}), keep_original=True)
    got_t5, got_clip = _encode(pipe.text_encoder_2, ids), _encode(pipe.text_encoder, ids)
    assert _quantized(pipe.text_encoder_2) == {p: "fp8_per_tensor" for p in _linears(t5, ("DenseReluDense",))}
    assert _quantized(pipe.text_encoder) == {p: "int8_per_row" for p in _linears(clip)}  # a module as the key
    frontend = pipe.transformer.runtime.state["frontend"]
    assert [p.name for p in frontend.passes] == ["fp8_linear"] and frontend.quantize_config.quant_type == "float8_per_row"
    assert 0 < _rel(got_t5, want_t5) < 0.1
    assert 0 < _rel(got_clip, want_clip) < 0.05
    assert cache_dit.strify(pipe)  # the transformer's own config is the one it reports
    cache_dit.disable_cache(pipe)
    assert pipe.text_encoder_2 is t5 and pipe.text_encoder is clip


def test_only_the_listed_components_are_quantized(ids):
    pipe = _pipeline()
    want = _call(pipe)
    t5 = pipe.text_encoder_2
    cache_dit.enable_cache(pipe, quantize_config=cache_dit.QuantizeConfig(
        quant_type="float8_per_row", components_to_quantize=[pipe.text_encoder_2]), keep_original=True)
    got = _call(pipe)
    _encode(pipe.text_encoder_2, ids)
    assert _rel(got, want) <= 1e-5  # the transformer is not quantized: the pipeline's latents as before
    assert _quantized(pipe.transformer) == {} and set(_quantized(pipe.text_encoder_2).values()) == {"fp8_per_row"}
    cache_dit.disable_cache(pipe)
    assert pipe.text_encoder_2 is t5


def test_refusals_name_the_way_out():
    pipe = _pipeline()
    with pytest.raises(ValueError, match="pass the pipeline"):
        cache_dit.enable_cache(pipe.transformer, quantize_config=cache_dit.QuantizeConfig(
            components_to_quantize=["transformer", "text_encoder"]))
    with pytest.raises(ValueError, match="SVDQuant quantizes the transformer"):
        cache_dit.QuantizeConfig(quant_type="svdq_int4_r8_dq", components_to_quantize=["text_encoder"]).to_passes()
    with pytest.raises(ValueError, match="tokenizer is not a module"):
        cache_dit.enable_cache(pipe, quantize_config=cache_dit.QuantizeConfig(components_to_quantize=["tokenizer"]))
    with pytest.raises(ValueError, match="fields"):
        cache_dit.QuantizeConfig(components_to_quantize={"text_encoder": {"no_such_field": 1}}).to_passes()
    assert not isinstance(pipe.transformer, CompiledDiT) and not isinstance(pipe.text_encoder_2, CompiledDiT)


class _Encoder(torch.nn.Module):
    """A stand-in encoder: its config's width (``hidden_size``, or T5's ``d_model``) and a linear of that width."""

    def __init__(self, width, key="hidden_size"):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(**{key: width})
        self.proj = torch.nn.Linear(width, width)


def test_main_text_encoder_is_chosen_by_structure(caplog):
    """cache-dit names the pipelines whose ``text_encoder_2`` is the small one; here widths decide, giving the
    reference's answer on its pipelines' layouts: ``text_encoder_2`` first (FLUX's T5 beside a CLIP; SD3 / HiDream's
    CLIP-G beside a CLIP-L, before their T5 in ``text_encoder_3``), unless it is narrower than ``text_encoder``
    (an LLM encoder beside a CLIP / ByT5) or the transformer attends to ``text_encoder``'s width only (a BERT
    beside an mT5 whose output is projected); equal widths keep the order. ``extra_parallel_modules`` names resolve
    by the same rule."""
    from types import SimpleNamespace
    from dit_passes.frontend.components import extra_modules, main_text_encoder

    def pipe(transformer_context=None, **encoders):
        transformer = SimpleNamespace(config=SimpleNamespace(cross_attention_dim=transformer_context))
        return SimpleNamespace(transformer=transformer, components=encoders, **encoders)
    assert main_text_encoder(pipe(text_encoder=_Encoder(768), text_encoder_2=_Encoder(4096, "d_model"))) \
        == "text_encoder_2"  # a CLIP and a T5
    assert main_text_encoder(pipe(text_encoder=_Encoder(768), text_encoder_2=_Encoder(1280),
                                  text_encoder_3=_Encoder(4096, "d_model"))) == "text_encoder_2"  # the reference's
    assert main_text_encoder(pipe(text_encoder=_Encoder(4096), text_encoder_2=_Encoder(768))) == "text_encoder"
    assert main_text_encoder(pipe(1024, text_encoder=_Encoder(1024), text_encoder_2=_Encoder(2048, "d_model"))) \
        == "text_encoder"  # the transformer's context is the first encoder's
    assert main_text_encoder(pipe(text_encoder=_Encoder(32), text_encoder_2=_Encoder(32, "d_model"))) \
        == "text_encoder_2"  # a tie (the tiny test pipelines): the reference's order
    assert main_text_encoder(pipe(text_encoder=_Encoder(64), text_encoder_2=None,
                                  vision_language_encoder=_Encoder(16))) == "vision_language_encoder"
    assert main_text_encoder(pipe(text_encoder=_Encoder(64))) == "text_encoder"
    with pytest.raises(ValueError, match="holds no text encoder"):
        main_text_encoder(pipe(vae=_Encoder(4)))
    wide, narrow, vae = _Encoder(64), _Encoder(16), _Encoder(4)
    p = pipe(text_encoder=wide, text_encoder_2=narrow, vae=vae, controlnet=None)
    with caplog.at_level("WARNING", logger="dit_passes"):
        assert extra_modules(p, ["text_encoder", "vae", narrow, "controlnet"]) == [wide, vae, narrow]
    assert "has no module 'controlnet'" in caplog.text  # skipped with a warning, as the reference does


def test_ray_workers_build_each_transformers_own_quantization():
    """With ``use_ray`` the workers build each transformer's passes from a tuple of configs, one per
    ``transformer`` / ``transformer_2`` (``components_to_quantize=["transformer"]`` on a two-transformer pipeline
    quantizes the first only, as without Ray): the engine's i-th transformer gets the i-th."""
    from dit_passes.frontend.api import _worker_passes
    from dit_passes.frontend.components import plan
    from types import SimpleNamespace
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    pipe = SimpleNamespace(transformer=first, transformer_2=second, components={})
    transformers, others = plan(pipe, cache_dit.QuantizeConfig(quant_type="int8_per_row",
                                                               components_to_quantize=["transformer"]))
    qs = tuple(transformers.get(n) for n in ("transformer", "transformer_2"))
    assert others == [] and qs[1] is None
    assert [p.name for p in _worker_passes(None, qs, None, None, module=first, index=0)] == ["int8_linear"]
    assert _worker_passes(None, qs, None, None, module=second, index=1) == []


def test_calibrate_fn_gets_the_keyword_arguments_it_names():
    """cache-dit calls ``calibrate_fn`` with those of its keyword arguments the function names (all for
    ``**kwargs``, none for a function of no argument); its own observer object (``calibrator``) has no counterpart
    here: a function requiring it is refused, naming it."""
    from types import SimpleNamespace
    from dit_passes.frontend.calibration import call_calibrate_fn
    model, seen = torch.nn.Linear(2, 2), []
    config = SimpleNamespace(svdq_kwargs={"calibrate_precision": "fp64"}, calibrate_fn=None)
    for fn, want in ((lambda: seen.append({}), {}),
                     (lambda model, component_name: seen.append(dict(model=model, component_name=component_name)),
                      {"model": model, "component_name": "Linear"}),
                     (lambda **kw: seen.append(kw), {"model": model, "quantize_config": config,
                                                     "component_name": "Linear", "svdq_kwargs": config.svdq_kwargs})):
        config.calibrate_fn = fn
        call_calibrate_fn(config, model)
        assert seen.pop() == want
    config.calibrate_fn = lambda model, calibrator: None
    with pytest.raises(TypeError, match=r"requires \['calibrator'\]"):
        call_calibrate_fn(config, model)


def test_vae_quantized_through_its_decode_graph():
    """``components_to_quantize=["vae"]`` (cache-dit quantizes its linears too): the pipeline calls ``vae.decode``,
    so each decode is captured and its linears (the mid-block attention's four) rewritten; the decoded images stay
    within int8's bound of the unquantized ones, the latents are unchanged; ``disable_cache`` puts the VAE back."""
    pipe = _pipeline()
    vae = pipe.vae
    want = _call(pipe)
    cache_dit.enable_cache(pipe, quantize_config=cache_dit.QuantizeConfig(quant_type="int8_per_row",
                                                                          components_to_quantize=["vae"]))
    got = _call(pipe)
    (key, gm), = pipe.vae._graphs.items()
    assert key[0] == "decode" and _quantized(pipe.transformer) == {}
    assert _quantized(gm) == {f"vae.{p}": "int8_per_row" for p in _linears(vae) if p.startswith("decoder.")}
    assert 0 < _rel(got, want) < 0.05, _rel(got, want)
    cache_dit.disable_cache(pipe)
    assert pipe.vae is vae
