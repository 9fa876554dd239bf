"""The FLUX transformer in plain PyTorch, for machines without diffusers (the GPU benchmark machine).

``FluxDiT(**config)`` takes the configuration of diffusers' ``FluxTransformer2DModel`` (``patch_size``,
``in_channels``, ``num_layers``, ``num_single_layers``, ``attention_head_dim``, ``num_attention_heads``,
``joint_attention_dim``, ``pooled_projection_dim``, ``guidance_embeds``, ``axes_dims_rope``), has the same
parameter names (a state dict loads either way) and computes the same function, op for op: 19 + 38 blocks of
FLUX.1-dev with ``FLUX_DEV``. ``forward`` takes diffusers' keyword arguments (``hidden_states``,
``encoder_hidden_states``, ``pooled_projections``, ``timestep``, ``img_ids``, ``txt_ids``, ``guidance``,
``return_dict``) and returns a 1-tuple ``(sample,)``. Written from the architecture (double-stream blocks with
joint attention, single-stream blocks, AdaLN-Zero modulation, 3-axis RoPE), without LoRA, IP-adapter,
ControlNet or attention-processor hooks. ``tests/test_flux_plain.py`` checks it against diffusers.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
_EPS = 1e-6


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=_EPS)


def _sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """[B] -> [B, dim]: cos then sin of t times ``max_period ** (-i / (dim / 2))``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _rope(ids: torch.Tensor, axes: Sequence[int], theta: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """ids [S, n_axes] -> (cos, sin) [S, sum(axes)], each frequency repeated for the (real, imag) pair."""
    pos = ids.float()
    f64 = torch.float32 if ids.device.type in ("mps", "npu") else torch.float64
    cos, sin = [], []
    for i, dim in enumerate(axes):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=f64, device=ids.device) / dim))
        angles = torch.outer(pos[:, i], freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def _apply_rope(x: torch.Tensor, rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B, S, H, D], rotating each (even, odd) channel pair."""
    cos, sin = (r[None, :, None, :] for r in rope)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class _MLP(nn.Module):
    """Two linears around ``act`` (SiLU: the time / text embedders)."""

    def __init__(self, d_in: int, d_hidden: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class _Modulation(nn.Module):
    """AdaLN: ``linear(silu(temb))`` cut into ``chunks`` vectors [B, dim]."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.linear, self.chunks = nn.Linear(dim, chunks * dim), chunks

    def forward(self, temb: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.chunks, dim=1)


class _GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


def _feed_forward(dim: int) -> nn.Module:
    ff = nn.Module()
    ff.net = nn.ModuleList([_GeluProj(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])
    return ff


def _ff(ff: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ff.net[2](ff.net[0](x))


class _Attention(nn.Module):
    """Multi-head attention with RMS-normed q / k; ``joint``: a second (text) stream with its own projections,
    attended together with the image stream (text first), each stream projected out by its own linear."""

    def __init__(self, dim: int, heads: int, head_dim: int, joint: bool):
        super().__init__()
        self.head_dim = head_dim
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=_EPS), nn.RMSNorm(head_dim, eps=_EPS)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, heads * head_dim) for _ in range(3))
        if joint:
            self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim), nn.Dropout(0.0)])
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=_EPS), nn.RMSNorm(head_dim, eps=_EPS)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, heads * head_dim) for _ in range(3))
            self.to_add_out = nn.Linear(heads * head_dim, dim)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (-1, self.head_dim))

    def forward(self, x: torch.Tensor, rope, context: Optional[torch.Tensor] = None):
        q, k, v = self.norm_q(self._heads(self.to_q(x))), self.norm_k(self._heads(self.to_k(x))), self._heads(self.to_v(x))
        if context is not None:
            cq = self.norm_added_q(self._heads(self.add_q_proj(context)))
            ck = self.norm_added_k(self._heads(self.add_k_proj(context)))
            q, k = torch.cat([cq, q], dim=1), torch.cat([ck, k], dim=1)
            v = torch.cat([self._heads(self.add_v_proj(context)), v], dim=1)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        out = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v)))
        out = out.permute(0, 2, 1, 3).flatten(2, 3).to(q.dtype)
        if context is None:
            return out
        ctx_out, out = out.split_with_sizes([context.shape[1], out.shape[1] - context.shape[1]], dim=1)
        return self.to_out[0](out.contiguous()), self.to_add_out(ctx_out.contiguous())


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class FluxDoubleBlock(nn.Module):
    """Image and text streams, each modulated by its own AdaLN-Zero, joined in one attention."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1, self.norm1_context = _Modulation(dim, 6), _Modulation(dim, 6)
        self.attn = _Attention(dim, heads, head_dim, joint=True)
        self.ff, self.ff_context = _feed_forward(dim), _feed_forward(dim)

    def forward(self, x, context, temb, rope):
        shift, scale, gate, shift2, scale2, gate2 = self.norm1(temb)
        cshift, cscale, cgate, cshift2, cscale2, cgate2 = self.norm1_context(temb)
        nx = _layer_norm(x) * (1 + scale[:, None]) + shift[:, None]
        nc = _layer_norm(context) * (1 + cscale[:, None]) + cshift[:, None]
        attn, cattn = self.attn(nx, rope, context=nc)
        x = x + gate.unsqueeze(1) * attn
        x = x + gate2.unsqueeze(1) * _ff(self.ff, _layer_norm(x) * (1 + scale2[:, None]) + shift2[:, None])
        context = context + cgate.unsqueeze(1) * cattn
        ff_c = _ff(self.ff_context, _layer_norm(context) * (1 + cscale2[:, None]) + cshift2[:, None])
        context = context + cgate2.unsqueeze(1) * ff_c
        return _clip_fp16(context), _clip_fp16(x)


class FluxSingleBlock(nn.Module):
    """The joint sequence (text then image) through parallel attention and MLP, one AdaLN-Zero."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm = _Modulation(dim, 3)
        self.proj_mlp = nn.Linear(dim, 4 * dim)
        self.proj_out = nn.Linear(5 * dim, dim)
        self.attn = _Attention(dim, heads, head_dim, joint=False)

    def forward(self, x, context, temb, rope):
        n_txt = context.shape[1]
        x = torch.cat([context, x], dim=1)
        shift, scale, gate = self.norm(temb)
        nx = _layer_norm(x) * (1 + scale[:, None]) + shift[:, None]
        mlp = F.gelu(self.proj_mlp(nx), approximate="tanh")
        h = torch.cat([self.attn(nx, rope), mlp], dim=2)
        x = _clip_fp16(x + gate.unsqueeze(1) * self.proj_out(h))
        return x[:, :n_txt], x[:, n_txt:]


class FluxDiT(nn.Module):
    """The FLUX transformer (module docstring)."""

    def __init__(self, patch_size: int = 1, in_channels: int = 64, out_channels: Optional[int] = None,
                 num_layers: int = 19, num_single_layers: int = 38, attention_head_dim: int = 128,
                 num_attention_heads: int = 24, joint_attention_dim: int = 4096, pooled_projection_dim: int = 768,
                 guidance_embeds: bool = False, axes_dims_rope: Sequence[int] = (16, 56, 56)):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.axes_dims_rope = tuple(axes_dims_rope)
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = _MLP(256, dim)
        if guidance_embeds:
            self.time_text_embed.guidance_embedder = _MLP(256, dim)
        self.time_text_embed.text_embedder = _MLP(pooled_projection_dim, dim)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.x_embedder = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            [FluxDoubleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [FluxSingleBlock(dim, num_attention_heads, attention_head_dim) for _ in range(num_single_layers)])
        self.norm_out = _Modulation(dim, 2)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * (out_channels or in_channels))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: Optional[torch.Tensor] = None, return_dict: bool = False):
        x = self.x_embedder(hidden_states)
        emb = self.time_text_embed
        temb = emb.timestep_embedder(_sinusoid(timestep.to(x.dtype) * 1000).to(pooled_projections.dtype))
        if guidance is not None:
            temb = temb + emb.guidance_embedder(_sinusoid(guidance.to(x.dtype) * 1000).to(pooled_projections.dtype))
        temb = temb + emb.text_embedder(pooled_projections)
        context = self.context_embedder(encoder_hidden_states)
        rope = _rope(torch.cat((txt_ids, img_ids), dim=0), self.axes_dims_rope)
        for block in self.transformer_blocks:
            context, x = block(x, context, temb, rope)
        for block in self.single_transformer_blocks:
            context, x = block(x, context, temb, rope)
        scale, shift = self.norm_out.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=1)
        x = _layer_norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
        return (self.proj_out(x),)
