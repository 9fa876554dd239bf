"""Weight-only int4 linears (W4A16): the weight half of W4A4, the activations left in their dtype.

For the linears whose input is the conditioning vector (the AdaLN modulation linears: one row per sample), where
activation quantization costs accuracy and buys no speed (the GEMV is bound by reading the weight). Preparation
is W4A4's weight quantization as is (:func:`dit_passes.quant.int4.quantize_weight_w4`: symmetric int4 per row and
group of 64 along K, bf16 group scales ``amax / 7``, two values per byte); every element then lies within half its
group's scale of the original, ``|w - q * wscale| <= wscale / 2`` (the scale is ``amax / 7`` rounded to bf16, at
most 2**-9 off, so ``|w| / wscale <= 7.02`` and rounding alone gives q: the clamp never cuts). The linear runs as
plain ATen ops written into the graph: :func:`dit_passes.quant.graph_forms.w4a16_linear_form`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .int4 import quantize_weight_w4


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


__all__ = ["W4A16Weight", "prepare_w4a16"]
