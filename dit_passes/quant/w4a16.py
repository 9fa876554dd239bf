"""Weight-only int4 linears (W4A16): the weight half of W4A4, the activations left in their dtype.

For the linears whose input is the conditioning vector (the AdaLN modulation linears: one row per sample), where
activation quantization costs accuracy and buys no speed (the GEMV is bound by reading the weight). Preparation
is W4A4's weight quantization as is (:func:`dit_passes.quant.int4.quantize_weight_w4`: symmetric int4 per row and
group of 64 along K, bf16 group scales ``amax / 7``, two values per byte); every element then lies within half its
group's scale of the original, ``|w - q * wscale| <= wscale / 2`` (the scale is ``amax / 7`` rounded to bf16, at
most 2**-9 off, so ``|w| / wscale <= 7.02`` and rounding alone gives q: the clamp never cuts). The linear runs as
plain ATen ops written into the graph: :func:`dit_passes.quant.weight_only_forms.w4a16_linear_form`.

W4A16 with SVDQuant's low-rank branch (kind ``w4a16_lr``, :func:`prepare_w4a16_lr`): ``W ~= lora_up @ lora_down``
(rank r, the factors in the activation dtype, from the seeded randomized SVD of W: SVDQuant's branch,
:func:`dit_passes.quant.svdquant.low_rank_split`, without smoothing since the activations are not quantized) plus
the int4 quantization above of the residual ``W - lora_up @ lora_down``. The branch takes W's largest singular
directions (and with them the outlier rows / columns that widen int4's group scales), so the residual's groups
quantize finer. Graph form: :func:`dit_passes.quant.weight_only_forms.w4a16_lr_linear_form`. Bytes per linear [N, K]:
W4A16's plus ``r * (N + K)`` factor elements (FLUX.1-dev's modulation linears, rank 32: +1.2% of W4A16's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .int4 import dequantize_weight_w4, fake_quant_w4_, quantize_weight_w4
from .svdquant import low_rank_split

# W4A16_LR's preparation (bench/results/quant_fidelity_w4a16lr_refined.md): two rounds refitting the branch to the
# residual's int4 error, and per-group scales searched for squared error among 16 clippings of amax
LR_REFINE_ITERS, LR_MSE_CLIP = 2, 16


@dataclass
class W4A16Weight:
    """qweight uint8 [N, K/2] (two int4 per byte, the even k in the low nibble), wscale bf16 [N, K/64], bias [N]
    or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    bias: Optional[torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors by field name (``bias`` only when present): the op's arguments and what is serialized."""
        out = {"qweight": self.qweight, "wscale": self.wscale}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


def prepare_w4a16(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> W4A16Weight:
    """Quantize one linear's weight [N, K] (K a multiple of 64) to int4 per group; the bias is kept as is."""
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    qweight, wscale = quantize_weight_w4(weight.detach())
    return W4A16Weight(qweight, wscale, None if bias is None else bias.detach().clone())


@dataclass
class W4A16LRWeight:
    """W4A16 of the residual plus the low-rank branch: qweight uint8 [N, K/2], wscale bf16 [N, K/64], lora_down
    [r, K] and lora_up [N, r] (activation dtype), bias [N] or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    lora_down: torch.Tensor
    lora_up: torch.Tensor
    bias: Optional[torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors by field name (``bias`` only when present): the op's arguments and what is serialized."""
        out = {"qweight": self.qweight, "wscale": self.wscale, "lora_down": self.lora_down, "lora_up": self.lora_up}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def effective_weight(self) -> torch.Tensor:
        """The fp32 weight [N, K] this stands for: ``dequant(residual) + lora_up @ lora_down``."""
        return dequantize_weight_w4(self.qweight, self.wscale) + self.lora_up.float() @ self.lora_down.float()


def prepare_w4a16_lr(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, rank: int = 32, seed: int = 0,
                     dtype: Optional[torch.dtype] = None, refine_iters: int = LR_REFINE_ITERS,
                     mse_clip: int = LR_MSE_CLIP) -> W4A16LRWeight:
    """Split one linear's weight [N, K] (K a multiple of 64) into SVDQuant's rank-``rank`` branch (factors in
    ``dtype``, default the weight's) and the int4-per-group residual; the bias is kept as is. ``refine_iters``
    rounds refit the branch to what the residual's quantization leaves (``svdquant.low_rank_split``); ``mse_clip``
    candidate scales per group (``int4.quantize_weight_w4``; 0: amax / 7)."""
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    lora_up, lora_down, residual = low_rank_split(
        weight.detach().float(), rank, seed, dtype or weight.dtype, refine_iters=refine_iters if rank else 0,
        fake_quant=lambda r: fake_quant_w4_(r, mse_clip))  # in place: the residual is low_rank_split's own
    qweight, wscale = quantize_weight_w4(residual, mse_clip)
    return W4A16LRWeight(qweight, wscale, lora_down, lora_up, None if bias is None else bias.detach().clone())


__all__ = ["W4A16Weight", "prepare_w4a16", "W4A16LRWeight", "prepare_w4a16_lr"]
