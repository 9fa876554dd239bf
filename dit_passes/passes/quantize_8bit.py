"""The torchao-style quantization passes: ``Fp8Linear`` (e4m3), ``Int8Linear``, ``Int4WeightOnly`` and
``NVFP4WeightOnly``, the flow of
``quantize._QuantizeLinears`` (selection, tables, substitution; see ``quantize.py``'s docstring for the graphs they
write). cache-dit's torchao types map onto them and their options (``frontend/configs.py``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from ..quant.fp8_block import BLOCK as FP8_BLOCK, prepare_fp8_block
from ..quant.fp8_int8 import FP8_GRANULARITIES, INT8_GRANULARITIES, prepare_fp8, prepare_int8
from ..quant.int4 import GROUP_SIZE
from ..quant.nvfp4 import BLOCK as NVFP4_BLOCK
from ..quant.nvfp4_weight_only import prepare_nvfp4_weight_only
from ..quant.w4a16 import prepare_w4a16
from ..quant.w8a16 import prepare_w8a16
from .quantize import W4A16, W8A16, _QuantizeLinears
from .quantize_select import DEFAULT_EXCLUDE


class Fp8Linear(_QuantizeLinears):
    """fp8 e4m3 weights, dynamic fp8 activations (per token and row, or one scale each: ``granularity``), written
    as plain ATen ops (module docstring); the AdaLN modulation linears too (``exclude=("modulation",)`` keeps them).

    ``granularity="per_block"`` (cache-dit's ``float8_per_block``): one scale per ``block x block`` tile of the
    weight, the activations per token and ``block`` input features (``quant/fp8_block.py``), through
    ``dit_passes.fp8_block_linear``; linears whose N or K is not a multiple of ``block`` stay unquantized (listed).
    ``weight_only=True`` (cache-dit's ``float8_weight_only``): e4m3 weights per output row, dequantized into the
    linear at run time, the activations left in their dtype (``weight_only_forms.w8a16_linear_form``).

    How the linears are written (``quant/forms.py``; the defaults chosen per device by
    ``quant/dispatch.device_default``): ``fast_accum`` (``_scaled_mm``'s ``use_fast_accum``; None: on), ``act_quant``
    (per-row activations as ATen ops, ``"graph"``, or as the op ``dit_passes::fp8_quantize_rows``, ``"kernel"``;
    ``"auto"``: the kernel on sm_89+ GPUs), ``weight_only_form`` (``weight_only=True`` on a few rows of x:
    ``"linear"`` / ``"rows"``)."""

    name = "fp8_linear"

    def __init__(self, granularity: str = "per_row", include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None,
                 serialize_to=None, regional=True, block_classes=None, weight_only: bool = False,
                 block: int = FP8_BLOCK, verbose: bool = False, fast_accum: Optional[bool] = None,
                 act_quant: str = "auto", weight_only_form: str = "auto"):
        super().__init__(include, exclude, filter_fn, serialize_to, regional, block_classes, verbose, weight_only_form)
        self.forms = dataclasses.replace(self.forms, fast_accum=fast_accum, act_quant=act_quant)
        grans = FP8_GRANULARITIES + ("per_block",)
        if granularity not in grans:
            raise ValueError(f"granularity must be one of {grans}, got {granularity!r}")
        if weight_only and granularity != "per_row":
            raise ValueError(f"weight_only=True stores the weights per output row (cache-dit's float8_weight_only); "
                             f"granularity={granularity!r} sets the activations' scales, which it leaves unquantized")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int (the tile side, cache-dit's 128), got {block!r}")
        self.granularity, self.weight_only, self.block = granularity, bool(weight_only), block
        self.kind = "fp8_weight_only" if weight_only else f"fp8_{granularity}"
        fp8_graph = self.kind in ("fp8_per_row", "fp8_per_tensor")  # the kinds written as the fp8 graph form
        self.check_forms({} if fp8_graph else {
            k: f"{self.kind} runs no fp8 graph form" for k in ("fast_accum", "act_quant")})
        if self.kind == "fp8_per_tensor":
            self.check_forms({"act_quant": "a per-tensor scale stays in the graph form"})

    def quant_type(self) -> str:
        return "fp8_e4m3_weight_only" if self.weight_only else f"fp8_e4m3_{self.granularity}"

    def config(self) -> Dict[str, Any]:
        return {**super().config(), **({"block": self.block} if self.granularity == "per_block" else {})}

    def k_multiple(self, kind: str) -> int:
        return self.block if kind == "fp8_per_block" else 1

    def cannot_quantize(self, site) -> Optional[str]:
        why = super().cannot_quantize(site)
        if why is None and self.kind == "fp8_per_block" and site.out_features % self.block:
            why = f"N % {self.block} != 0 (fp8_per_block takes the weight in {self.block} x {self.block} tiles)"
        return why

    def prepare(self, path, weight, bias, absmax, kind):
        if kind == "fp8_per_block":
            return prepare_fp8_block(weight, bias, self.block).tensors()
        return prepare_fp8(weight, bias, self.granularity).tensors()


class Int8Linear(_QuantizeLinears):
    """int8 weights (symmetric per row) and dynamic per-token int8 activations, int32 accumulation;
    ``granularity="per_tensor"``: one scale for the weight, one per call for the activations
    (``dit_passes.int8_tensor_linear``; cache-dit's ``int8_per_tensor``). ``weight_only=True`` (cache-dit's
    ``int8_weight_only``): the int8 weights per output row dequantized into the linear at run time, the activations
    left in their dtype (the W8A16 form, ``quant/w8a16.py``)."""

    name = "int8_linear"

    def __init__(self, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None, serialize_to=None, regional=True,
                 block_classes=None, granularity: str = "per_row", weight_only: bool = False, verbose: bool = False,
                 weight_only_form: str = "auto"):
        super().__init__(include, exclude, filter_fn, serialize_to, regional, block_classes, verbose, weight_only_form)
        if granularity not in INT8_GRANULARITIES:
            raise ValueError(f"granularity must be one of {INT8_GRANULARITIES}, got {granularity!r}")
        if weight_only and granularity != "per_row":
            raise ValueError(f"weight_only=True stores the weights per output row (cache-dit's int8_weight_only); "
                             f"granularity={granularity!r} sets the activations' scales, which it leaves unquantized")
        self.granularity, self.weight_only = granularity, bool(weight_only)
        self.kind = W8A16 if weight_only else f"int8_{granularity}"
        self.check_forms({})

    def quant_type(self) -> str:
        return "int8_weight_only" if self.weight_only else f"int8_{self.granularity}"

    def prepare(self, path, weight, bias, absmax, kind):
        if kind == W8A16:
            return prepare_w8a16(weight, bias).tensors()
        return prepare_int8(weight, bias, self.granularity).tensors()


class Int4WeightOnly(_QuantizeLinears):
    """Weight-only int4 (cache-dit's ``int4_weight_only``): symmetric int4 weights per group of 64 input features
    with a bf16 scale each, dequantized into the linear at run time, the activations left in their dtype (the W4A16
    form of SVDQuant's modulation linears, ``quant/w4a16.py``). A linear whose K is not a multiple of 64 stays in its
    precision and is listed in ``explain()``. torchao's own form groups 128 features with a zero point per group:
    the same storage cost to within its zero points, not the same rounding."""

    name = "int4_weight_only"
    kind = W4A16

    def quant_type(self) -> str:
        return "int4_weight_only"

    def k_multiple(self, kind: str) -> int:
        return GROUP_SIZE

    def prepare(self, path, weight, bias, absmax, kind):
        return prepare_w4a16(weight, bias).tensors()


class NVFP4WeightOnly(_QuantizeLinears):
    """Weight-only NVFP4 (cache-dit's ``nvfp4_weight_only``, torchao's ``NVFP4WeightOnlyConfig`` with its per-tensor
    scale): e2m1 weights with an e4m3 scale per 16 input features and an fp32 global scale per linear, dequantized
    into the linear at run time, the activations left in their dtype (``quant/nvfp4_weight_only.py``: 4.5 bits per
    weight). Any device: the dequantization is plain ATen ops (Blackwell's FP4 tensor cores are not needed, since
    the activations are not quantized). A linear whose K is not a multiple of 16 stays in its precision and is
    listed in ``explain()``."""

    name = "nvfp4_weight_only"
    kind = "nvfp4_weight_only"

    def quant_type(self) -> str:
        return "nvfp4_weight_only"

    def k_multiple(self, kind: str) -> int:
        return NVFP4_BLOCK

    def prepare(self, path, weight, bias, absmax, kind):
        return prepare_nvfp4_weight_only(weight, bias).tensors()
