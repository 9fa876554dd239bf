"""The forms a quantized linear may be written in: the settings of the quantize passes that change the graph, the
numerics or the memory, as one value the passes hold (``SVDQuantW4A4(form="lut", lut_planes=3)``,
``Fp8Linear(fast_accum=False, act_quant="graph")``, ...), shown by their ``describe()`` (so part of every key a lowered
graph or a prepared table is cached under) and resolved per linear by ``dispatch.py`` when the graph is written.

``"auto"`` / ``None`` is the per-device default, chosen in one place: :func:`dispatch.device_default` (each default
cites the results file that chose it). Any other value is taken as asked on every device (a GPU-only kernel runs its
reference elsewhere, the same numbers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

# SVDQuant's linears (``SVDQuantW4A4(form=...)``): "op" (dit_passes::svdq_w4a4_linear, true W4A4: the reference
# numerics; its CUDA kernel chosen by the timing table), "triton" / "cutlass" (that op on that kernel), "fp8" (W4A8 on
# fp8 tensor cores, a graph form), "lrcat" / "lrcat_split" (the fp8 form with the low-rank branch in the GEMM's K; hi /
# lo branch operands), "w4a8" / "w4a8_fold" (dit_passes::svdq_w4a8_linear: the fused W4A8 kernels, exact / folded
# group scales), "lut" (the tables stored for the lookup-table GEMM, quant/w4_lut.py)
SVDQ_FORMS = ("auto", "op", "triton", "cutlass", "fp8", "lrcat", "lrcat_split", "w4a8", "w4a8_fold", "lut")
ACT_QUANT_SETTINGS = ("auto", "graph", "kernel")      # per-token fp8 activations: ATen ops or dit_passes' row op
W4_EXPAND_SETTINGS = ("auto", "graph", "kernel")      # int4 -> e4m3 weight expansion: ATen ops or the op
LRCAT_ACT_SETTINGS = ("auto", "mm", "stats")          # lrcat's A operand with the row kernel: after aten.mm / one op
WEIGHT_ONLY_SETTINGS = ("auto", "linear", "rows", "kernel")  # weight-only linears on a few rows of x
LUT_PLANE_CHOICES = (2, 3)                            # the LUT form's branch columns (h in e4m3 / hi + lo)
LUT_ACT_SETTINGS = ("auto", "rows", "lowrank")        # the LUT form's A operand with the row kernel


def _one_of(name: str, value: Any, choices: Tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class QuantForms:
    """How the quantize passes write their linears (module docstring). Each field's default, ``"auto"`` / ``None``,
    is :func:`dispatch.device_default`'s choice for the device the graph is lowered for."""

    form: str = "auto"                   # SVDQuant's linears: SVDQ_FORMS
    fast_accum: Optional[bool] = None    # _scaled_mm's use_fast_accum for the fp8 GEMMs
    act_quant: str = "auto"              # ACT_QUANT_SETTINGS (per-row scales; a per-tensor scale stays in the graph)
    w4_expand: str = "auto"              # W4_EXPAND_SETTINGS (SVDQuant's fp8 / lrcat forms)
    lrcat_act: str = "auto"              # LRCAT_ACT_SETTINGS (where act_quant takes the kernel)
    weight_only_form: str = "auto"       # WEIGHT_ONLY_SETTINGS
    lut_planes: Optional[int] = None     # LUT_PLANE_CHOICES
    lut_act: str = "auto"                # LUT_ACT_SETTINGS (where act_quant takes the kernel)

    def __post_init__(self) -> None:
        _one_of("form", self.form, SVDQ_FORMS)
        if self.fast_accum is not None and not isinstance(self.fast_accum, bool):
            raise ValueError(f"fast_accum must be None (the device default), True or False, got {self.fast_accum!r}")
        _one_of("act_quant", self.act_quant, ACT_QUANT_SETTINGS)
        _one_of("w4_expand", self.w4_expand, W4_EXPAND_SETTINGS)
        _one_of("lrcat_act", self.lrcat_act, LRCAT_ACT_SETTINGS)
        _one_of("weight_only_form", self.weight_only_form, WEIGHT_ONLY_SETTINGS)
        if self.lut_planes is not None:
            _one_of("lut_planes", self.lut_planes, LUT_PLANE_CHOICES)
        _one_of("lut_act", self.lut_act, LUT_ACT_SETTINGS)

    def items(self) -> Dict[str, Any]:
        """The fields set away from their device default, for a pass's ``describe()`` (a default adds nothing: the
        key of a lowered graph holds its device already)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


DEFAULT_FORMS = QuantForms()
