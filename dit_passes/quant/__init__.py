"""Quantization core: W4A4 SVDQuant, weight-only int8 / int4 (W8A16, W4A16, W4A16 + low rank), fp8 and int8 linears, their custom ops and
serialization.

Importing this package registers the ``torch.ops.dit_passes.*`` quantized-linear ops.
"""
from . import custom_ops, lut_ops  # noqa: F401  (registers the custom ops)
from .calibrate import ActAbsMaxObserver, collect_linear_act_absmax
from .forms import QuantForms
from .fp8_int8 import Fp8Weight, Int8Weight, fp8_linear_reference, int8_linear_reference, prepare_fp8, prepare_int8
from .int4 import (GROUP_SIZE, fused_act_quant_reference, pack_int4, quantize_activation_w4, quantize_weight_w4,
                   unpack_int4, w4a4_gemm_reference, w4a4_linear_reference)
from .serialize import (QuantizedCheckpointError, load_quantized, memory_report, save_quantized,
                        structure_signature)
from .svdquant import (SVDQuantWeight, prepare_svdquant, prepare_w4a4_plain, randomized_svd, relative_error,
                       search_alpha, smoothing_vector, svdq_w4a4_linear_reference)
from .w4a16 import W4A16LRWeight, W4A16Weight, prepare_w4a16, prepare_w4a16_lr
from .w8a16 import W8A16Weight, dequantize_w8a16, prepare_w8a16

__all__ = [
    "ActAbsMaxObserver", "collect_linear_act_absmax", "Fp8Weight", "Int8Weight", "fp8_linear_reference",
    "int8_linear_reference", "prepare_fp8", "prepare_int8", "GROUP_SIZE", "fused_act_quant_reference", "pack_int4",
    "quantize_activation_w4", "quantize_weight_w4", "unpack_int4", "w4a4_gemm_reference", "w4a4_linear_reference",
    "QuantizedCheckpointError", "load_quantized", "memory_report", "save_quantized", "structure_signature",
    "SVDQuantWeight", "prepare_svdquant", "prepare_w4a4_plain", "randomized_svd", "relative_error", "search_alpha",
    "smoothing_vector", "svdq_w4a4_linear_reference", "W4A16Weight", "prepare_w4a16", "W4A16LRWeight",
    "prepare_w4a16_lr",
    "W8A16Weight", "dequantize_w8a16", "prepare_w8a16", "QuantForms",
]
