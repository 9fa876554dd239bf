"""CompiledDiT as a drop-in transformer of a real diffusers FluxPipeline, and its per-signature graphs.

The reference is always the original transformer run eagerly on the same inputs: with ``passes=[]``
the captured graph computes the same ATen ops in the same order, so results must match exactly.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.models.modeling_outputs import Transformer2DModelOutput  # noqa: E402

TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16   # in_channels=16: the pipeline packs 4 latent channels in 2x2 patches


def tiny_flux(seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=IN_CH, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def tiny_pipe(transformer) -> FluxPipeline:
    torch.manual_seed(1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1).eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def flux_call(batch: int, tokens: int, text: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, tokens, IN_CH, generator=g),
                encoder_hidden_states=torch.randn(batch, text, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(batch, POOLED_DIM, generator=g),
                timestep=torch.rand(batch, generator=g), img_ids=torch.randn(tokens, 3, generator=g),
                txt_ids=torch.zeros(text, 3), guidance=torch.full((batch,), 3.5))


def run_pipeline(pipe: FluxPipeline, cfg: bool, steps: int = 3, size: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 7, TEXT_DIM, generator=g)
    pooled = torch.randn(1, POOLED_DIM, generator=g)
    extra = {}
    if cfg:  # true CFG: a second call per step under cache_context("uncond")
        extra = dict(negative_prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
                     negative_pooled_prompt_embeds=torch.randn(1, POOLED_DIM, generator=g), true_cfg_scale=2.0)
    with torch.inference_mode():
        out = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=size, width=size,
                   num_inference_steps=steps, guidance_scale=3.5, output_type="latent",
                   generator=torch.Generator().manual_seed(3), **extra)
    return out.images


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "true_cfg"])
def test_flux_pipeline_same_latents(cfg):
    transformer = tiny_flux()
    pipe = tiny_pipe(transformer)
    pipe.set_progress_bar_config(disable=True)
    ref = run_pipeline(pipe, cfg)

    compiled = compile_dit(transformer, passes=[])
    contexts = []  # the cache context active at each transformer call (a public nn.Module hook)
    compiled.register_forward_pre_hook(lambda mod, args, kwargs: contexts.append(mod.runtime.context),
                                       with_kwargs=True)
    pipe.transformer = compiled
    pipe.to("cpu")
    got = run_pipeline(pipe, cfg)

    assert got.shape == ref.shape and not torch.isnan(got).any()
    assert torch.equal(got, ref), f"max abs diff {(got - ref).abs().max().item()}"
    assert contexts == (["cond", "uncond"] if cfg else ["cond"]) * 3  # 3 steps
    assert compiled.runtime.context == "default"  # restored after the pipeline
    assert compiled.runtime.calls == 3 * (2 if cfg else 1)
    assert len(compiled.graphs) == 1  # cond and uncond share one signature


def test_drop_in_identity():
    transformer = tiny_flux()
    compiled = compile_dit(transformer)
    assert compiled.config is transformer.config
    assert compiled.dtype == torch.float32 and compiled.device == torch.device("cpu")
    assert compiled.config.in_channels == IN_CH
    with pytest.raises(RuntimeError, match="nothing captured yet"):
        compiled.structure
    inputs = flux_call(1, 16, 8)
    with torch.no_grad():
        ref = transformer(**inputs, return_dict=False)[0]
        out_dict = compiled(**inputs)
        out_tuple = compiled(**inputs, return_dict=False)
    assert isinstance(out_dict, Transformer2DModelOutput) and torch.equal(out_dict.sample, ref)
    assert isinstance(out_tuple, tuple) and len(out_tuple) == 1 and torch.equal(out_tuple[0], ref)
    assert len(compiled.graphs) == 1  # return_dict is handled outside the graph


def test_signatures_resolutions_cfg_batch_text_length():
    transformer = tiny_flux()
    compiled = compile_dit(transformer, passes=[])
    calls = [(1, 16, 8), (1, 36, 8), (2, 16, 8), (1, 16, 11), (1, 16, 8), (2, 16, 8)]
    seen_keys = []
    for i, (batch, tokens, text) in enumerate(calls):
        inputs = flux_call(batch, tokens, text, seed=i)
        with torch.no_grad():
            ref = transformer(**inputs, return_dict=False)[0]
            out = compiled(**inputs, return_dict=False)[0]
        assert out.shape == (batch, tokens, IN_CH)
        assert torch.equal(out, ref), f"call {i} {(batch, tokens, text)}: max diff {(out - ref).abs().max()}"
        seen_keys.append(len(compiled.graphs))
    # one graph per new signature; the repeated signatures (calls 4 and 5) reuse theirs
    assert seen_keys == [1, 2, 3, 4, 4, 4]
    # each graph is specialised to its own shapes (static), so none can silently serve another
    shapes = sorted(tuple(n.meta["val"].shape) for gm in compiled.graphs.values()
                    for n in gm.graph.nodes if n.op == "placeholder" and n.name == "hidden_states")
    assert shapes == [(1, 16, IN_CH), (1, 16, IN_CH), (1, 36, IN_CH), (2, 16, IN_CH)]


def test_constant_argument_is_part_of_signature():
    transformer = tiny_flux()
    compiled = compile_dit(transformer)
    inputs = flux_call(1, 16, 8)
    with torch.no_grad():
        a = compiled(**inputs, joint_attention_kwargs=None, return_dict=False)[0]
        b = compiled(**inputs, joint_attention_kwargs={}, return_dict=False)[0]
    assert torch.equal(a, b)
    assert len(compiled.graphs) == 2  # None vs {} differ as constants: captured separately


def test_two_instances_do_not_share_state():
    transformer = tiny_flux()
    a, b = compile_dit(transformer), compile_dit(transformer)
    with a.cache_context("uncond"):
        assert a.runtime.context == "uncond" and b.runtime.context == "default"
    assert a.runtime is not b.runtime
