"""Weight-only int8 linears (W8A16): int8 weights per output row, the activations left in their dtype.

The default form of the AdaLN modulation linears under SVDQuant (their input is the conditioning vector, one row
per sample: activation quantization costs accuracy and buys the GEMV no speed, and int4 weights cost the images
more than the bytes they save are worth on a quarter of the model). Preparation is the int8 weight quantization of
:class:`dit_passes.passes.Int8Linear` (:func:`dit_passes.quant.fp8_int8.quantize_int8_rows`): symmetric per row,
``wscale[n] = amax|w[n]| / 127`` in fp32 (a zero scale becomes 1), ``q = clamp(rint(w / wscale), -127, 127)``.
Every element then lies within half its row's scale of the original, ``|w - q * wscale| <= wscale / 2`` (the
clamp never cuts: ``|w| / wscale <= 127`` up to one fp32 rounding). The linear runs as plain ATen ops written into
the graph (:func:`dit_passes.quant.weight_only_forms.w8a16_linear_form`): the weight dequantized, then ``aten.linear``.

Bytes per linear [N, K]: ``N * K`` (int8) + ``4 * N`` (scales) + the bias, about half the bf16 weight.
"""
from __future__ import annotations

from typing import Optional

import torch

from .fp8_int8 import Int8Weight, prepare_int8

W8A16Weight = Int8Weight  # the same tensors as Int8Linear's weights: qweight int8 [N, K], wscale fp32 [N], bias


def prepare_w8a16(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> W8A16Weight:
    """Quantize one linear's weight [N, K] (any K) to int8 per output row; the bias is kept as is. The tables are
    Int8Linear's (``fp8_int8.prepare_int8``); only the activations differ (left in their dtype here)."""
    return prepare_int8(weight, bias)


def dequantize_w8a16(qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] the form computes with (before its cast to the activation dtype)."""
    return qweight.float() * wscale.float().unsqueeze(1)


__all__ = ["W8A16Weight", "prepare_w8a16", "dequantize_w8a16"]
