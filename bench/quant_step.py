"""The FLUX.1-dev-size step on one H200: compiled bf16 against the quantization passes, in one process.

Run on the GPU machine from the repository root with dit_passes installed (diffusers is not needed: the model is
``dit_passes.models.flux_plain.FluxDiT``, FLUX.1-dev's configuration with random bf16 weights)::

    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \\
        && PYTHONPATH=/tmp/site python3 bench/quant_step.py --out "$OUT"

and on a CPU, end to end on a small model (backend "eager")::

    python bench/quant_step.py --tiny --out /tmp/quant_step

Only the per-linear table for chosen designs (``--linears-only``: no step rows)::

    PYTHONPATH=/tmp/site python3 bench/quant_step.py --linears-only --linears bf16_mm,svdq_w4a8_fused --out "$OUT"

Only the fusion rows and their baselines, no per-linear table (about 3 minutes on an H100)::

    PYTHONPATH=/tmp/site python3 bench/quant_step.py --rows bf16,bf16_fused,fp8_fast_accum,fp8_fused \
        --linears '' --budget-s 200 --out "$OUT"

Step rows (``--rows``), 1024² (4096 image + 512 text tokens), batch 1, ``compile_dit`` plus ``RegionalCompile``
(Inductor) on every row, each lowered, compiled, timed and freed before the next:

* ``bf16``: no quantization; ``bf16_epilogue``: ``SplitConcatLinear`` and ``FuseLinearGelu`` (phase EPILOGUES: the
  single blocks' proj_out on its two parts in place, no concatenated copy; the MLPs' tanh-GELU in cuBLASLt's
  epilogue), still bf16, the lossless step; ``bf16_epilogue_cdt``: the same with Inductor's
  ``coordinate_descent_tuning`` (:data:`COMPILE_OPTIONS`);
* ``fp8`` / ``fp8_fast_accum``: ``Fp8Linear(exclude=())`` on every block linear, the AdaLN modulation ones included
  (per-channel e4m3 weights, per-token e4m3 activations quantized in the graph, ``_scaled_mm``), with
  ``fast_accum`` = False / True;
* ``bf16_fused`` / ``fp8_fused``: ``FuseSiblingLinears()`` first (each block's q / k / v, and in the single-stream
  blocks proj_mlp with them, one linear over the concatenated weight and a split), then nothing / the
  ``fp8_fast_accum`` row's ``Fp8Linear``: one activation quantization and one wider GEMM per group;
  ``fp8_fused_rowquant``: ``fp8_fused`` with ``act_quant="kernel"`` (each activation quantized by the
  op ``dit_passes::fp8_quantize_rows``: one Triton kernel, one read, ``kernels/fp8_rowquant_triton.py``);
* ``svdq_w4_fp8`` / ``svdq_w4_fp8_fast_accum``: ``SVDQuantW4A4(rank=32, dynamic=True)`` written as W4A8 on fp8
  tensor cores (``form="fp8"``: the packed int4 weights expanded to e4m3 once per call with the
  group scales folded, per-token e4m3 activations, ``_scaled_mm``, the rank-32 branch in bf16); the AdaLN
  modulation linears weight-only int8 (the pass's default ``modulation="w8a16"``: dequantized to bf16 per call);
* ``svdq_w4_fp8_fused`` / ``svdq_w4_fp8_fused_expandkernel``: ``FuseSiblingLinears()`` then the
  ``svdq_w4_fp8_fast_accum`` row's pass (SVDQuant of the concatenated q / k / v (+ proj_mlp) weight), the int4 weights
  expanded by ATen ops / by the op ``dit_passes::w4_to_e4m3`` (``w4_expand="kernel"``: one
  bandwidth-bound Triton kernel, ``kernels/w4_expand_triton.py``);
* ``svdq_w4_lrcat``: the ``svdq_w4_fp8_fused_expandkernel`` row with ``form="lrcat"``: the low-rank
  branch folded into the GEMM's K (``graph_forms.svdq_lrcat_linear_form``: one ``_scaled_mm`` over [qx | qh] and
  [w8 | u8], no separate branch mm / addmm over the output; B written by ``dit_passes::w4_lrcat_to_e4m3``);
  ``svdq_w4_lrcat_split``: the same with the branch's operands as e4m3 hi / lo pairs (3R columns: the svdq fp8
  form's fidelity back); ``svdq_w4_lrcat_split_nofuse`` / ``svdq_w4_fp8_expandkernel``: without
  ``FuseSiblingLinears`` (a fused group shares one rank-32 branch: digits DiT PTQ 46.2 -> 41.3 dB, fp8 form and
  lrcat_split alike, ``bench/results/quant_fidelity_*_fused.md``), lrcat_split / the svdq fp8 form with the kernel;
* ``svdq_w4_lrcat_split_act`` / ``_act_nofuse``: ``svdq_w4_lrcat_split`` / ``_nofuse`` with
  ``act_quant="kernel"``: each linear's A operand (smoothing, per-token e4m3, the branch's down
  projection) by the op ``dit_passes::lrcat_quantize_rows``, one Triton kernel (``kernels/lrcat_act_triton.py``);
  ``*_graphed`` of these and of ``svdq_w4_lrcat_split``: the step as one CUDA graph, as the bf16 / fp8 rows;
* ``svdq_w4_all_fp8_fast_accum``: the same with ``modulation="svdq"``, the AdaLN modulation linears W4A8 too;
* ``svdq_w4_w4a8_fused`` / ``svdq_w4_w4a8_fused_fold`` (not by default): the same pass with
  ``form="w4a8"`` / ``w4a8_fold``: each linear the op ``dit_passes::svdq_w4a8_linear``, the fused
  W4A8 Triton kernels (``kernels/w4a8_triton.py``);
* ``bf16_epilogue_rope`` / ``fp8_default_rope`` / ``svdq_w4_default_rope``: ``bf16_epilogue`` / ``fp8_default`` /
  ``svdq_w4_default`` plus ``FuseNormRope`` (the q / k RMSNorm and rotary embedding as one op, lossless);
* ``bf16_pointwise`` / ``fp8_pointwise`` / ``svdq_w4_pointwise`` (graphed only): those plus ``FuseNormModulate``
  (AdaLN's LayerNorm + modulation, with the gated residual before it, as one op, lossless);
* ``svdq_w4_pointwise_words`` (graphed only): ``svdq_w4_pointwise`` with the expansion kernel's word form
  (``the kernel's ``form="words"````: a thread converts eight int4 values of an int32 word, not a byte's two);
* ``svdq_w4_lut_pointwise`` / ``svdq_w4_lut2_pointwise`` / ``svdq_w4_expand_pointwise`` (graphed only):
  ``svdq_w4_pointwise`` with each SVDQuant design named: the lookup-table form (``form="lut"``,
  ``quant/w4_lut.py``: the int4 codes read by the CUTLASS mixed-input GEMM, the branch's three planes,
  ``lut_planes=3``; ``lut2``: two, the default; the LUT form is the Hopper default) and the expansion design
  (``lrcat_split``, the default before it); a row of the LUT form records the tile configs its GEMM's "auto" chose (``lut_configs``);
  ``svdq_w4_lut_rows_pointwise`` / ``svdq_w4_lut_lowrank_pointwise``: the LUT form's A operand named
  (``lut_act``: h by a cuBLAS mm, then the row kernel, the default; or the op computing h inside,
  ``kernels/lut_act_triton.py``; results made while lowrank was the default have lowrank
  ``svdq_w4_lut_pointwise`` and ``lut2`` rows: each results file says);
* ``svdq_w4_op`` (not by default): the same weights through the custom op, true W4A4 on the CUTLASS kernels
  (``form="cutlass"``: built with the device's nvcc on first use; ``auto`` now writes W4A8 on Hopper).

Each row: ``first_call_s`` (capture, passes, Inductor), ``step_ms`` (median of ``--repeats`` after two warm-ups),
``rel_err_vs_bf16`` (output, Frobenius), ``weights_gib`` (tensors the lowered graph holds), ``original_only_gib``
(the original module's weights CompiledDiT keeps besides), ``peak_gib`` (allocated, over the timed steps).
``bf16_compiled_ms``, ``fp8_compiled_ms`` and ``svdq_w4_compiled_ms`` summarise them (the fastest fp8 / SVDQuant
W4 r32 row, named by ``fp8_design`` / ``svdq_w4_design``); ``step_ms`` has every row's.

Per linear (``linear_ms``), M = 4608, the four FLUX shapes K x N: ``bf16_mm`` (``torch.mm``), ``fp8`` /
``fp8_fast_accum`` (the pass's graph form compiled alone: activation quantization included), ``fp8_gemm``
(``_scaled_mm`` on pre-quantized operands), ``fp8_rowquant`` (``fp8_fast_accum`` with the op
``dit_passes::fp8_quantize_rows``), ``fp8_act`` / ``fp8_act_rowquant`` (the activation quantization alone: Inductor's
form / the op; GB/s of one bf16 read and one e4m3 write), ``svdq_fp8`` / ``svdq_fp8_fast_accum`` (rank 32, smoothing
calibrated on the same activations; the W4A8 form compiled alone, weight expansion and low-rank branch included;
``rel_err_w4a4_reference``: true W4A4's error on the same weights), ``w4_expand`` / ``w4_expand_kernel`` (the int4
-> e4m3 weight expansion alone: Inductor's form / the op ``dit_passes::w4_to_e4m3``; GB/s of the packed read and
the e4m3 write), ``svdq_fp8_fast_accum_expandkernel`` (``svdq_fp8_fast_accum`` with the op's expansion),
``svdq_lrcat`` / ``svdq_lrcat_expandkernel`` (the lrcat form, fast accumulation, B by ATen ops / by the op),
``svdq_lrcat_split_expandkernel`` (its hi / lo split, B by the op), ``lrcat_act`` (its A operand alone by the op
``dit_passes::lrcat_quantize_rows``: GB/s of one bf16 read and one e4m3 write), ``svdq_lrcat_split_act``
(``svdq_lrcat_split_expandkernel`` with that op),
``svdq_w4a8_fused`` / ``_fold`` (``dit_passes::svdq_w4a8_linear``, the fused W4A8 Triton kernels: group scales exact
in fp32 / folded into the e4m3 weights), ``w4a8_act`` / ``w4a8_gemm`` / ``w4a8_gemm_fold`` (its two kernels
alone: the activation pass, the GEMM on pre-quantized activations; GPU only), ``svdq_op`` (the custom op; not by
default); each with TFLOP/s, speedup over ``bf16_mm`` and the relative error against the fp32 linear (random
activations with 1% outlier channels, weights as ``nn.Linear`` initialises them; bias included; ``bf16_mm``'s error is
``F.linear``'s, its time ``torch.mm``'s).
``ms_b2b``: ``--linear-b2b`` calls back to back between two events (GPU time, the per-call Python / launch overhead
hidden; ``ms`` starts each call on an idle GPU, so counts it); ``ms_graph``: as many calls captured in one CUDA graph
and replayed (the linear as the graphed step runs it: no host time, the gaps between its kernels kept);
``rel_err_vs_bf16``: a design's error against the bf16 linear (``F.linear``), beside ``rel_err_vs_fp32``. Writes ``quant_step.json`` / ``.md`` to ``--out``
after every row; rows not started within ``--budget-s`` are skipped (the device call has a time limit).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

# the sibling module: bench/ is sys.path[0] for `python bench/quant_step.py`, but not under `python -P`
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_step_linears import RANK, clear_svdq, linear_designs, svdq, w4a8_tile  # noqa: E402
from quant_step_report import markdown, save as save_report  # noqa: E402
from cuda_timing import back_to_back_ms, graphed_ms, median_ms, sync  # noqa: E402
from dit_passes.kernels.w4a8_lut_cutlass import CONFIGS as LUT_CONFIGS  # noqa: E402

FULL = dict(img=4096, txt=512, m=4608, shapes=((3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072)))
TINY_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
                   num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
                   axes_dims_rope=(8, 12, 12))
TINY = dict(img=64, txt=8, m=72, shapes=((64, 64), (64, 256), (256, 64), (320, 64)))
# default order: the likely fastest designs first (rows not started within --budget-s are skipped)
ROWS = ("bf16", "fp8_fast_accum", "fp8_fused", "fp8_fused_rowquant", "bf16_fused", "svdq_w4_fp8_fused_expandkernel",
        "svdq_w4_lrcat", "svdq_w4_lrcat_split", "svdq_w4_lrcat_split_nofuse", "svdq_w4_fp8_expandkernel",
        "svdq_w4_fp8_fast_accum", "svdq_w4_fp8_fused", "svdq_w4_all_fp8_fast_accum", "fp8", "svdq_w4_fp8",
        "svdq_w4_w4a8_fused", "svdq_w4_w4a8_fused_fold", "svdq_w4_op", "bf16_graphed", "fp8_fused_graphed",
        "fp8_fused_rowquant_graphed", "svdq_w4_lrcat_split_act", "svdq_w4_lrcat_split_act_nofuse",
        "svdq_w4_lrcat_split_graphed", "svdq_w4_lrcat_split_act_graphed", "svdq_w4_lrcat_split_act_nofuse_graphed",
        "svdq_w4_lrcat_split_act_modrows", "svdq_w4_lrcat_split_act_modrows_graphed", "svdq_w4_default",
        "svdq_w4_default_graphed", "fp8_default", "fp8_default_graphed", "svdq_w4_lrcat_split_mm",
        "svdq_w4_lrcat_split_mm_graphed", "bf16_epilogue", "bf16_epilogue_graphed", "bf16_epilogue_cdt_graphed",
        "bf16_epilogue_rope", "fp8_default_rope", "svdq_w4_default_rope", "bf16_epilogue_rope_graphed",
        "fp8_default_rope_graphed", "svdq_w4_default_rope_graphed", "bf16_pointwise_graphed", "fp8_pointwise_graphed",
        "svdq_w4_pointwise_graphed", "svdq_w4_lut_pointwise_graphed",
        "svdq_w4_lut2_pointwise_graphed", "svdq_w4_lut_rows_pointwise_graphed", "svdq_w4_lut_lowrank_pointwise_graphed",
        "svdq_w4_expand_pointwise_graphed")
# Inductor options of a row (its _graphed twin too): cdt, Inductor's coordinate-descent tuning of its own kernels'
# block sizes (the RMSNorm + RoPE kernel of the bf16 step runs at ~1 TB/s; more compile time)
COMPILE_OPTIONS = {"bf16_epilogue_cdt": {"coordinate_descent_tuning": True}}
DEFAULT_ROWS = ROWS[:ROWS.index("svdq_w4_w4a8_fused")]  # the rest on request
LINEARS = ("bf16_mm", "fp8", "fp8_fast_accum", "fp8_gemm", "fp8_rowquant", "fp8_act", "fp8_act_rowquant", "svdq_fp8",
           "svdq_fp8_fast_accum", "svdq_w4a8_fused", "svdq_w4a8_fused_fold", "w4a8_act", "w4a8_gemm", "w4a8_gemm_fold",
           "w4_expand", "w4_expand_kernel", "svdq_fp8_fast_accum_expandkernel", "svdq_lrcat", "svdq_lrcat_expandkernel",
           "svdq_lrcat_split_expandkernel", "lrcat_act", "svdq_lrcat_split_act", "svdq_op", "svdq_lrcat_split_mm",
           "svdq_lut", "svdq_lut_lowrank", *(f"w4a8_gemm_lut_{c}" for c in LUT_CONFIGS))
DEFAULT_LINEARS = LINEARS[:LINEARS.index("svdq_op")]


def log(*a) -> None:
    print(*a, flush=True)


def row_specs():
    """{row: (make_passes(forms) -> the pass list, forms)}: ``forms``, the quantize pass's form arguments
    (``dit_passes.quant.forms.QuantForms``'s fields) the row names."""
    from dit_passes.passes import FuseLinearGelu, FuseNormModulate, FuseNormRope, FuseSiblingLinears, SplitConcatLinear
    from dit_passes.passes.quantize import Fp8Linear, SVDQuantW4A4
    from dit_passes.quant.forms import LUT_ACT_SETTINGS

    def tagged(make, kind):
        make.kind = kind  # which quantize pass the row's forms go to (named() below)
        return make

    def plain(*classes):
        return tagged(lambda q: [c() for c in classes], "bf16")

    def fp8(fuse=False):
        return tagged(lambda q: ([FuseSiblingLinears()] if fuse else []) + [Fp8Linear(exclude=(), **q)], "fp8")

    def svdq(fuse=True, **fixed):
        return tagged(lambda q: ([FuseSiblingLinears()] if fuse else []) + [
            SVDQuantW4A4(rank=RANK, dynamic=True, **fixed, **q)], "svdq_mod" if fixed else "svdq")

    exact, fast = {"fast_accum": False}, {"fast_accum": True}
    w4a8, rowquant = {"form": "fp8"}, {"act_quant": "kernel"}
    expand = {"w4_expand": "kernel"}
    # the modulation linears on their one row: the int4 GEMV op (the "rows" form is its own row below)
    mod_gemv = {"weight_only_form": "kernel"}
    two_kernels = {"lrcat_act": "stats"}  # the _act rows' A operand (the default: mm)
    specs = {
        "bf16": (plain(), {}),
        "bf16_epilogue": (plain(SplitConcatLinear, FuseLinearGelu), {}),
        "bf16_epilogue_cdt": (plain(SplitConcatLinear, FuseLinearGelu), {}),
        "fp8": (fp8(), exact),
        "fp8_fast_accum": (fp8(), fast),
        # q / k / v (+ proj_mlp) fused into one linear before quantizing: one activation quantization, one wider GEMM
        "fp8_fused": (fp8(fuse=True), fast),
        "fp8_fused_rowquant": (fp8(fuse=True), {**fast, **rowquant}),
        "bf16_fused": (plain(FuseSiblingLinears), {}),
        "svdq_w4_fp8": (svdq(fuse=False), {**w4a8, **exact}),
        "svdq_w4_fp8_fast_accum": (svdq(fuse=False), {**w4a8, **fast}),
        # q / k / v (+ proj_mlp) fused first as in fp8_fused; the int4 weights expanded by ATen ops / by the op
        "svdq_w4_fp8_fused": (svdq(), {**w4a8, **fast}),
        "svdq_w4_fp8_fused_expandkernel": (svdq(), {**w4a8, **fast, **expand}),
        # the low-rank branch in the GEMM's K (one _scaled_mm per linear), B written by the expansion kernel
        "svdq_w4_lrcat": (svdq(), {"form": "lrcat", **fast, **expand}),
        "svdq_w4_lrcat_split": (svdq(), {"form": "lrcat_split", **fast, **expand}),
        # unfused: SVDQuant's fidelity at rank 32 per linear (fused groups share one rank-32 branch: -5 dB on digits)
        "svdq_w4_lrcat_split_nofuse": (svdq(fuse=False), {"form": "lrcat_split", **fast, **expand}),
        "svdq_w4_fp8_expandkernel": (svdq(fuse=False), {**w4a8, **fast, **expand}),
        # lrcat_split with its A operand by dit_passes::lrcat_quantize_rows (smoothing, e4m3, branch down: one kernel)
        # and the modulation linears' int4 GEMV (weight_only_form="kernel")
        "svdq_w4_lrcat_split_act": (svdq(), {"form": "lrcat_split", **fast, **expand, **rowquant, **mod_gemv,
                                             **two_kernels}),
        "svdq_w4_lrcat_split_act_nofuse": (svdq(fuse=False), {"form": "lrcat_split", **fast, **expand, **rowquant,
                                                              **mod_gemv, **two_kernels}),
        # the A operand as aten.mm for the branch's down projection (on the smoothed activation, which Inductor writes
        # in its producer) and one row pass (dit_passes::lrcat_quantize_smoothed) instead of the two kernels
        "svdq_w4_lrcat_split_mm": (svdq(), {"form": "lrcat_split", **fast, **expand, **rowquant, **mod_gemv,
                                            "lrcat_act": "mm"}),  # the default
        # the same with the modulation linears' multiply-and-sum rows form instead of the GEMV
        "svdq_w4_lrcat_split_act_modrows": (svdq(), {"form": "lrcat_split", **fast, **expand, **rowquant,
                                                     "weight_only_form": "rows", **two_kernels}),
        # the AdaLN modulation linears W4A8 like the rest (the default rows: weight-only int8)
        "svdq_w4_all_fp8_fast_accum": (svdq(fuse=False, modulation="svdq"), {**w4a8, **fast}),
        # the fused W4A8 Triton kernels (dit_passes::svdq_w4a8_linear), exact / folded group scales
        "svdq_w4_w4a8_fused": (svdq(fuse=False), {"form": "w4a8"}),
        "svdq_w4_w4a8_fused_fold": (svdq(fuse=False), {"form": "w4a8_fold"}),
        "svdq_w4_op": (svdq(fuse=False), {"form": "cutlass"}),
    }
    # each row names its forms: the device defaults ("auto": the kernels on sm_89+) apply to the *_default rows only,
    # which measure what a user gets with no setting; a row names only the forms its pass writes (one it would not act
    # on is refused)
    def named(kind, q):
        form, out = q.get("form"), {}
        if kind == "fp8" or (kind.startswith("svdq") and form in ("fp8", "lrcat", "lrcat_split")):
            out["act_quant"] = "graph"
        if kind.startswith("svdq") and form in ("fp8", "lrcat", "lrcat_split"):
            out["w4_expand"] = "graph"
        if kind == "svdq":  # the modulation linears weight-only (modulation="svdq": W4A8 like the rest)
            out["weight_only_form"] = "linear"
        return out

    specs = {n: (make, {**named(make.kind, q), **q}) for n, (make, q) in specs.items()}
    specs["svdq_w4_default"] = (svdq(), {})
    specs["fp8_default"] = (fp8(fuse=True), {})
    # *_rope: plus FuseNormRope (lossless: the q / k RMSNorm and rotary embedding as one op of ours)
    specs["bf16_epilogue_rope"] = (plain(SplitConcatLinear, FuseLinearGelu, FuseNormRope), {})
    specs["fp8_default_rope"] = (lambda q: [*fp8(fuse=True)(q), FuseNormRope()], {})
    specs["svdq_w4_default_rope"] = (lambda q: [*svdq()(q), FuseNormRope()], {})
    # *_pointwise: the *_rope rows plus FuseNormModulate (lossless: AdaLN's norm + modulation as one op of ours)
    for name, rope in (("bf16_pointwise", "bf16_epilogue_rope"), ("fp8_pointwise", "fp8_default_rope"),
                       ("svdq_w4_pointwise", "svdq_w4_default_rope")):
        specs[name] = (lambda q, rope=rope: [*specs[rope][0](q), FuseNormModulate()], specs[rope][1])
    # the lookup-table form: the int4 codes read by the CUTLASS mixed-input GEMM through per-group e4m3 tables
    # (quant/w4_lut.py), no expanded weight; the branch as int4 digit planes in K (three; lut2: their two-plane prefix)
    # (the planes named on both rows: the default is two)
    specs["svdq_w4_lut_pointwise"] = (specs["svdq_w4_pointwise"][0], {"form": "lut", "lut_planes": 3})
    # the same with the branch's two planes (h in e4m3): the GEMM 64-128 columns shorter (the default)
    specs["svdq_w4_lut2_pointwise"] = (specs["svdq_w4_pointwise"][0], {"form": "lut", "lut_planes": 2})
    # the A operand named: h by cuBLAS's mm, then the row kernel (xd read twice; the default), or the lowrank op
    # (xd's amax in its producer, h inside the op; xd read once)
    for act in LUT_ACT_SETTINGS[1:]:
        specs[f"svdq_w4_lut_{act}_pointwise"] = (specs["svdq_w4_pointwise"][0], {"form": "lut", "lut_act": act})
    # the expansion design (lrcat_split, the Hopper default before the LUT form) named, now that auto stores the LUT form
    specs["svdq_w4_expand_pointwise"] = (specs["svdq_w4_pointwise"][0], {"form": "lrcat_split"})
    # *_graphed: the step replayed as one CUDA graph (mode="reduce-overhead"): the per-call host work of a row with
    # more, smaller kernels (the row kernel's ~300 calls a step) hidden as a generation hides it
    graphed = ("bf16", "fp8_fused", "fp8_fused_rowquant", "svdq_w4_lrcat_split", "svdq_w4_lrcat_split_act",
               "svdq_w4_lrcat_split_act_nofuse", "svdq_w4_lrcat_split_act_modrows", "svdq_w4_default", "fp8_default",
               "svdq_w4_lrcat_split_mm", "bf16_epilogue", "bf16_epilogue_cdt", "bf16_epilogue_rope", "fp8_default_rope",
               "svdq_w4_default_rope", "bf16_pointwise", "fp8_pointwise", "svdq_w4_pointwise", "svdq_w4_lut_pointwise", "svdq_w4_lut2_pointwise",
               "svdq_w4_lut_rows_pointwise", "svdq_w4_lut_lowrank_pointwise", "svdq_w4_expand_pointwise")
    return {**specs, **{f"{n}_graphed": specs[n] for n in graphed}}


def memory_bound(ms: float, b2b, nbytes: int, gpu=None) -> Dict[str, Any]:
    """A bandwidth-bound row: ms and GB/s, with calls back to back (a short kernel's time is mostly the op's
    Python / launch overhead when each call starts on an idle GPU) and by the kernels' own time (``gpu``)."""
    out = {"ms": ms, "gb_per_s": nbytes / (ms * 1e6)}
    if gpu:
        out.update(gpu_ms=gpu, gb_per_s_gpu=nbytes / (gpu * 1e6))
    return out if b2b is None else {**out, "ms_b2b": b2b, "gb_per_s_b2b": nbytes / (b2b * 1e6)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def gib(n: float) -> float:
    return n / 2**30


def cleanup(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------------- steps
def tensor_bytes(tensors) -> Dict[int, int]:
    """{data_ptr: bytes}, each storage once."""
    return {t.data_ptr(): t.numel() * t.element_size() for t in tensors if not t.is_meta}  # meta: released, no bytes


def step_row(name: str, make_passes, forms: Dict[str, Any], model, kw, ref, args, device) -> Dict[str, Any]:
    from dit_passes import compile_dit

    compile_kwargs = {"backend": "eager"} if args.tiny else {}
    if name.endswith("_graphed"):
        compile_kwargs["mode"] = "reduce-overhead"
    options = COMPILE_OPTIONS.get(name.removesuffix("_graphed"))
    if options and not args.tiny:
        compile_kwargs["options"] = options
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled = compile_dit(model, passes=make_passes(forms), torch_compile={"regional": True, **compile_kwargs})
        out = compiled(**kw)[0]
        sync(device)
        first = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = median_ms(lambda: compiled(**kw), args.repeats, device)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        # GPU time by kernel kind (GEMM, attention, quantize, fused, ...): where a missed target's time goes
        profiled = step_profile(lambda: compiled(**kw), args.profile_steps) if args.profile_steps else None
        gm = compiled.graph_module
        held = tensor_bytes(list(gm.parameters()) + list(gm.buffers()))
        original = tensor_bytes(model.parameters())
        records = compiled._current().manager.records
        row = {"first_call_s": first, "step_ms": ms,
               "rel_err_vs_bf16": 0.0 if ref is None else rel_err(out.float(), ref),
               "weights_gib": gib(sum(held.values())),
               "original_only_gib": gib(sum(b for p, b in original.items() if p not in held)),
               "peak_gib": gib(peak), "forms": forms, **({"profile": profiled} if profiled else {}),
               "passes": {r.name: r.result.report for r in records if r.name != "cleanup"}}
        lut = sys.modules.get("dit_passes.kernels.w4a8_lut_cutlass")
        if lut is not None and lut.tuned_configs():  # the LUT GEMM's tile configs "auto" chose, per (M, N, K)
            row["lut_configs"] = {"x".join(map(str, key[:3])): c for key, c in lut.tuned_configs().items()}
    del compiled
    cleanup(device)
    return row, out.float()


def step_profile(fn: Callable[[], Any], steps: int) -> Dict[str, Any]:
    """profile_flux_step's measure (beside this script): kernel ms per step by kind, wall ms, launches."""
    from profile_flux_step import _profile
    return _profile(fn, steps)


# ------------------------------------------------------------------------------------------------ linears
def linear_rows(sizes, designs: List[str], args, device) -> Dict[str, Dict[str, Any]]:
    build = linear_designs(device, args.tiny)
    m = sizes["m"]
    out: Dict[str, Dict[str, Any]] = {}
    for k, n in sizes["shapes"]:
        g = torch.Generator(device=device).manual_seed(k * 7 + n)
        # activations with a few outlier channels (as DiT activations have), weights as nn.Linear initialises them
        x = torch.randn(m, k, device=device, generator=g) * (1 + 8 * (torch.rand(k, device=device, generator=g) > 0.99))
        x = x.to(torch.bfloat16)
        w = ((torch.rand(n, k, device=device, generator=g) * 2 - 1) * k ** -0.5).to(torch.bfloat16)
        b = ((torch.rand(n, device=device, generator=g) * 2 - 1) * k ** -0.5).to(torch.bfloat16)
        ref = x.float() @ w.float().t() + b.float()
        ref_bf16 = torch.nn.functional.linear(x, w, b).float()  # the error against the bf16 linear, the reference a user compares with
        key = f"{k}x{n}"
        res: Dict[str, Any] = {}
        with torch.no_grad():
            for name in designs:
                fn = build[name](x, w, b)
                if fn is None:
                    continue
                # memory-bound designs report GB/s: the expansion (packed int4 + scales read, e4m3 written), the
                # activation passes (bf16 x read, e4m3 written)
                nbytes = (n * k // 2 + n * k if name.startswith("w4_expand") else
                          m * k * x.element_size() + m * k if name in ("w4a8_act", "fp8_act", "fp8_act_rowquant",
                                                                       "lrcat_act") else None)
                ms = median_ms(fn, args.linear_repeats, device, warmup=3)
                b2b = back_to_back_ms(fn, args.linear_repeats, device, args.linear_b2b)
                # kernel time alone: a short op's event times measure its host launch path (calls back to back too)
                gpu = step_profile(fn, 5)["gpu_ms"] if device.type == "cuda" else None
                if nbytes is not None:
                    res[name] = memory_bound(ms, b2b, nbytes, gpu)
                    continue
                graphed = graphed_ms(fn, args.linear_repeats, device, args.linear_b2b)
                if name.startswith("w4a8_gemm"):  # the GEMM alone: its time, no error of its own to report
                    res[name] = {"ms": ms, "ms_b2b": b2b, "ms_graph": graphed, "tflops": 2 * m * n * k / (ms * 1e9),
                                 **w4a8_tile(name)}
                    continue
                y = torch.nn.functional.linear(x, w, b) if name == "bf16_mm" else fn()
                res[name] = {"ms": ms, "ms_b2b": b2b, "ms_graph": graphed, "gpu_ms": gpu,
                             "tflops": 2 * m * n * k / (ms * 1e9),
                             "rel_err_vs_fp32": rel_err(y.float(), ref),
                             "rel_err_vs_bf16": rel_err(y.float(), ref_bf16), **w4a8_tile(name)}
            if any(d.startswith("svdq") for d in res):  # true W4A4 on the same weights, for the error only
                from dit_passes.quant import svdq_w4a4_linear_reference
                r4 = rel_err(svdq_w4a4_linear_reference(x, svdq(x, w, b)).float(), ref)
                for d in res:
                    if d.startswith("svdq"):
                        res[d]["rel_err_w4a4_reference"] = r4
            base = res.get("bf16_mm", {})
            for v in res.values():
                if "tflops" in v:
                    v["speedup_vs_bf16_mm"] = base["ms"] / v["ms"] if base.get("ms") else None
                    for field, speedup in (("ms_b2b", "speedup_b2b_vs_bf16_mm"),
                                           ("ms_graph", "speedup_graph_vs_bf16_mm"), ("gpu_ms", "speedup_gpu_vs_bf16_mm")):
                        if base.get(field) and v.get(field):
                            v[speedup] = base[field] / v[field]
        out[key] = res
        log("linear", key, {d: round(v["ms"], 4) for d, v in res.items()})
        clear_svdq()
        cleanup(device)
    return out


# ---------------------------------------------------------------------------------------------------- main
def save(r: Dict[str, Any], out: str) -> None:
    save_report(r, out, LINEARS)


def build_model(config: Dict[str, Any], device: torch.device):
    from dit_passes.models.flux_plain import FluxDiT

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of 12 B parameters
    try:
        with torch.device(device):
            return FluxDiT(**config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small model on the CPU, backend 'eager'")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"step rows, of {ROWS}")
    ap.add_argument("--linears", default=",".join(DEFAULT_LINEARS),
                    help=f"per-linear designs, of {LINEARS} ('' for none)")
    ap.add_argument("--linears-only", action="store_true", help="the per-linear table only, no step rows")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--linear-repeats", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many steps per row (GPU time by kind)")
    ap.add_argument("--linear-b2b", type=int, default=10,
                    help="also time this many per-linear calls back to back (ms_b2b: GPU time; 0: off)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no step row after this many seconds")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    rows = [] if args.linears_only else [r for r in args.rows.split(",") if r]
    designs = [d for d in args.linears.split(",") if d]
    unknown = sorted(set(rows) - set(ROWS)) + sorted(set(designs) - set(LINEARS))
    if unknown:
        ap.error(f"unknown rows / designs {unknown}")
    t_start = time.perf_counter()
    from dit_passes.bench import FLUX_DEV, flux_inputs

    device = torch.device("cpu" if args.tiny else "cuda")
    config, sizes = (TINY_CONFIG, TINY) if args.tiny else (FLUX_DEV, FULL)
    torch.set_num_threads(min(torch.get_num_threads(), 2) if args.tiny else torch.get_num_threads())
    r: Dict[str, Any] = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "torch": torch.__version__,
                         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "config": dict(config), "tokens": f"{sizes['img']} image + {sizes['txt']} text tokens, batch 1",
                         "compile": "backend eager" if args.tiny else "Inductor, default mode",
                         "linear_m": sizes["m"], "rows": {}, "skipped": [], "errors": {}}
    if designs:
        r["linears"] = linear_rows(sizes, designs, args, device)
        save(r, args.out)
    if args.linears_only:
        r["total_s"] = time.perf_counter() - t_start
        save(r, args.out)
        log(markdown(r, LINEARS))
        return 0
    kw = flux_inputs(config, sizes["img"], sizes["txt"], device, torch.bfloat16)
    specs = row_specs()
    ref = None
    for name in (["bf16"] if "bf16" not in rows else []) + rows:  # bf16 first: the reference output
        if time.perf_counter() - t_start > args.budget_s:
            r["skipped"].append(name)
            continue
        make_passes, forms = specs[name]
        # a fresh model per row (same seed, same weights): lowering releases the weights it replaces (each weight
        # held once), so a model a quantized row lowered cannot be lowered again from its full weights
        model = build_model(config, device)
        try:
            row, out = step_row(name, make_passes, forms, model, kw, ref, args, device)
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            r["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
            log(name, "FAILED", r["errors"][name])
            log(traceback.format_exc()[-4000:])  # where: a device run is too dear to repeat for it
            del model
            cleanup(device)
            continue
        del model
        cleanup(device)
        if ref is None:
            ref = out
        if name in rows:
            r["rows"][name] = row
            log(name, {k: v for k, v in row.items() if k not in ("passes", "forms")})
        save(r, args.out)
    r["total_s"] = time.perf_counter() - t_start
    save(r, args.out)
    log(markdown(r, LINEARS))
    return 0 if not r["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
