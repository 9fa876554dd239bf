"""Weight-only NVFP4 linears (cache-dit's ``nvfp4_weight_only``): the weights in the NVFP4 layout, the activations
left in their dtype.

cache-dit 1.5.3 maps ``nvfp4_weight_only`` to torchao's ``NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)``:
each selected linear's weight [N, K] becomes e2m1 values with an e4m3 scale per 16 along K and an fp32 per-tensor
scale ``amax|W| / (448 * 6)`` (so the largest block scale is e4m3's 448), and the linear runs as ``F.linear(x,
dequantize(W) in the weight's dtype, bias)``: no activation quantization. Here the tables are those of
``nvfp4.quantize_weight_nvfp4`` (the residual format of SVDQuant's NVFP4, ``nvfp4.py``): ``qweight`` uint8 [N, K/2]
(two e2m1 codes per byte, the even k in the low nibble), ``wscale`` float8_e4m3fn [N, K/16], ``wglobal`` fp32 [1],
the bias as is; each weight held once in that form, 4.5 bits per element plus 32 bits per tensor.

The linear (:func:`nvfp4_weight_only_linear_form`, plain ATen ops written into the graph, shape-generic)::

    w = x.dtype(e2m1(qweight) * float(wscale) per block of 16 * wglobal)      # [N, K]
    y = linear(x, w, bias)

``e2m1 * e4m3`` is exact in fp32 and the global scale one fp32 rounding, so in fp32 the form is the linear of
``nvfp4.dequantize_weight_nvfp4`` bit for bit; in bf16 the weight takes one more rounding (2**-9 relative, far below
the e2m1 step), as torchao's dequantization to the weight's dtype does.

Rounding against torchao's (``tests/test_nvfp4_weight_only.py`` compares the dequantized weights where torchao is
installed): the same scales; torchao scales an element by ``(1 / g) / s`` where this divides by ``s * g``, so an
element lying within an fp32 ulp of a rounding tie between two e2m1 neighbours may take the other one; torchao
clamps a block scale to at least 2**-6 (e4m3's smallest normal) where this keeps e4m3's subnormals (blocks under
1/28672 of the tensor's abs-max); an all-zero weight takes the global 1 here (torchao divides by its zero global).
torchao refuses weights whose N is not a multiple of 16 (its swizzled scale layout); here only K must be (the block
runs along K), and a linear whose K is not stays in its precision (listed by the pass).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .weight_only_forms import dequantized_linear
from .nvfp4 import BLOCK, dequantize_weight_nvfp4, e2m1_decode, quantize_weight_nvfp4, unpack_fp4

aten = torch.ops.aten
_F32 = torch.float32


@dataclass
class NVFP4WeightOnlyWeight:
    """qweight uint8 [N, K/2], wscale float8_e4m3fn [N, K/16], wglobal fp32 [1], bias [N] or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    wglobal: torch.Tensor
    bias: Optional[torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors by field name (``bias`` only when present): the form's arguments and what is serialized."""
        out = {"qweight": self.qweight, "wscale": self.wscale, "wglobal": self.wglobal}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def effective_weight(self) -> torch.Tensor:
        """The fp32 weight [N, K] this stands for (exact)."""
        return dequantize_weight_nvfp4(self.qweight, self.wscale, self.wglobal)


def prepare_nvfp4_weight_only(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> NVFP4WeightOnlyWeight:
    """Quantize one linear's weight [N, K] (K a multiple of 16) to NVFP4 with a per-tensor global scale; the bias is
    kept as is."""
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    qweight, wscale, wglobal = quantize_weight_nvfp4(weight.detach())
    return NVFP4WeightOnlyWeight(qweight, wscale, wglobal, None if bias is None else bias.detach().clone())


def nvfp4_weight_only_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                                  wglobal: torch.Tensor, bias: Optional[torch.Tensor],
                                  rows: bool = False) -> torch.Tensor:
    """Weight-only NVFP4 linear (module docstring): x [..., K], qweight uint8 [N, K/2], wscale e4m3 [N, K/16],
    wglobal fp32 [1], bias [N] or None -> [..., N] in x.dtype. No shape constants: traced once, it replaces any
    linear; ``rows``: as ``weight_only_forms.dequantized_linear``'s multiply-and-sum (a few rows of x)."""
    v = e2m1_decode(unpack_fp4(qweight))                                                     # [N, K] fp32
    s = aten.reshape.default(aten._to_copy.default(wscale, dtype=_F32), [-1, 1])            # [N * K/16, 1]
    w = aten.view_as.default(aten.mul.Tensor(aten.view.default(v, [-1, BLOCK]), s), v)      # block-major rows
    w = aten.mul.Tensor(w, aten._to_copy.default(wglobal, dtype=_F32))
    return dequantized_linear(x, w, bias, rows)


__all__ = ["NVFP4WeightOnlyWeight", "prepare_nvfp4_weight_only", "nvfp4_weight_only_linear_form"]
