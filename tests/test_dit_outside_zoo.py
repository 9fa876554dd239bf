"""A diffusers DiT outside the tiny zoo works without code changes.
AuraFlowTransformer2DModel (joint MMDiT blocks + single DiT blocks): passes=[] round trip exact and
block discovery (two lists, two streams, one attention per block)."""
from __future__ import annotations

from collections import Counter

import torch

from dit_passes import compile_dit


def test_auraflow_round_trip_and_discovery():
    import diffusers
    torch.manual_seed(0)
    m = diffusers.AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                             num_single_dit_layers=3, attention_head_dim=8, num_attention_heads=2,
                                             joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
                                             pos_embed_max_size=64).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
              timestep=torch.tensor([0.5]), return_dict=False)
    with torch.no_grad():
        ref = m(**kw)[0]
        c = compile_dit(m)
        out = c(**kw)[0]
    assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
    s = c.structure
    assert [(b.name, b.count) for b in s.block_lists] == [("joint_transformer_blocks", 2), ("single_transformer_blocks", 3)]
    assert s.num_streams == 2
    assert Counter(a.block for a in s.attention) == Counter(range(5))
    assert all((a.num_heads, a.head_dim) == (2, 8) for a in s.attention)
