"""The per-linear designs of ``bench/quant_step.py`` (its ``--linears``): name -> how to build the quantized
linear of one FLUX shape on given activations and weights (the script's docstring describes each). A module of its
own to keep the script short; it imports nothing from the script."""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

RANK = 32
_SVDQ: Dict[tuple, Any] = {}  # the current shape's SVDQuant weights, shared by its designs (cleared per shape)


def svdq(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """SVDQuant r32 of one linear, PTQ: smoothing from these activations' per-channel abs-max."""
    from dit_passes.quant import prepare_svdquant

    key = (x.data_ptr(), w.data_ptr(), tuple(x.shape), tuple(w.shape))
    if key not in _SVDQ:
        _SVDQ[key] = prepare_svdquant(w, b, act_absmax=x.float().abs().amax(0), rank=RANK, smooth="act",
                                      dtype=x.dtype)
    return _SVDQ[key]


def linear_designs(device: torch.device, tiny: bool) -> Dict[str, Callable]:
    """name -> (x, w, b) -> zero-argument callable computing the quantized linear (or None: not on this device)."""
    from dit_passes.kernels import lut_act_triton, w4a8_lut_cutlass as L
    from dit_passes.kernels.lrcat_act_triton import lrcat_quantize_smoothed
    from dit_passes.quant import dispatch, prepare_fp8, w4_lut
    from dit_passes.quant.graph_forms import (LinearShape, fp8_linear_form, fp8_quantize, lrcat_c, lrcat_cols,
                                              svdq_fp8_linear_form, svdq_lrcat_linear_form, w4_to_e4m3)

    backend = "eager" if tiny else "inductor"

    def bf16_mm(x, w, b):
        wt = w.t()
        return lambda: torch.mm(x, wt)

    def fp8(fast: bool):
        def build(x, w, b):
            f = prepare_fp8(w, b)
            n, k = w.shape
            gemm = dispatch.fp8_gemm_backend(x, n, k, "per_row")
            shape = LinearShape.of(x, n, k, f.bias, f.wscale)
            fn = torch.compile(lambda t: fp8_linear_form(t, f.qweight, f.wscale, f.bias, shape, "per_row", gemm,
                                                         fast and gemm == "scaled_mm"), backend=backend, fullgraph=True)
            return lambda: fn(x)
        return build

    def fp8_rowquant(x, w, b):  # the fast-accum form with its activations through dit_passes::fp8_quantize_rows
        f = prepare_fp8(w, b)
        n, k = w.shape
        gemm = dispatch.fp8_gemm_backend(x, n, k, "per_row")
        shape = LinearShape.of(x, n, k, f.bias, f.wscale)
        fn = torch.compile(lambda t: fp8_linear_form(t, f.qweight, f.wscale, f.bias, shape, "per_row", gemm,
                                                     gemm == "scaled_mm", "kernel"), backend=backend, fullgraph=True)
        return lambda: fn(x)

    def fp8_act(kernel: bool):  # the activation quantization alone: Inductor's form / the op
        def build(x, w, b):
            if kernel:
                return lambda: torch.ops.dit_passes.fp8_quantize_rows(x)
            fn = torch.compile(lambda t: fp8_quantize(t.float(), per_row=True), backend=backend, fullgraph=True)
            return lambda: fn(x)
        return build

    def fp8_gemm(x, w, b):
        if dispatch.fp8_gemm_backend(x, w.shape[0], w.shape[1], "per_row") != "scaled_mm":
            return None
        f = prepare_fp8(w, b)
        qx, sx = fp8_quantize(x.float(), per_row=True)
        qwt, sw = f.qweight.t(), f.wscale.reshape(1, -1)
        return lambda: torch._scaled_mm(qx, qwt, scale_a=sx, scale_b=sw, bias=f.bias, out_dtype=x.dtype)

    def svdq_op(x, w, b):
        q = svdq(x, w, b)
        args = (q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias)
        return lambda: torch.ops.dit_passes.svdq_w4a4_linear(x, *args)

    def svdq_fp8(fast: bool, expand: str = "graph", lrcat: str = "", act: str = "graph"):
        def build(x, w, b):
            q = svdq(x, w, b)
            n, k = w.shape
            split = lrcat == "split"
            gemm = dispatch.fp8_gemm_backend(x, n, k + (lrcat_cols(q.rank, split) if lrcat else 0), "per_row")
            shape = LinearShape.of(x, n, k, q.bias, q.wscale, rank=q.rank)
            args = (q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias)
            kw = {"split": split, "act_quant": act} if lrcat else {}
            form = svdq_lrcat_linear_form if lrcat else svdq_fp8_linear_form
            fn = torch.compile(lambda t: form(t, *args, shape, gemm, fast and gemm == "scaled_mm", expand, **kw),
                               backend=backend, fullgraph=True)
            return lambda: fn(x)
        return build

    def svdq_w4a8(fold: bool):
        def build(x, w, b):
            q = svdq(x, w, b)
            args = (q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias, fold)
            op = torch.ops.dit_passes.svdq_w4a8_linear.default  # the fused kernels on sm_89+, else the reference
            return lambda: op(x, *args)
        return build

    def w4a8_parts(part: str):
        def build(x, w, b):
            kernels = dispatch.w4a8_kernel_module() if device.type == "cuda" else None
            q = svdq(x, w, b)
            if kernels is None or not kernels.is_supported(x, q.qweight):
                return None
            if part == "act":
                return lambda: kernels.w4a8_act_quant(x, q.smooth_inv, q.lora_down)
            qx, sx, la = kernels.w4a8_act_quant(x, q.smooth_inv, q.lora_down)
            return lambda: kernels.w4a8_gemm(qx, sx, q.qweight, q.wscale, la, q.lora_up, q.bias, x.dtype,
                                             fold=part == "gemm_fold")
        return build

    def w4_expand(x, w, b):
        q = svdq(x, w, b)
        fn = torch.compile(lambda: w4_to_e4m3(q.qweight, q.wscale, q.N, q.K), backend=backend, fullgraph=True)
        return fn

    def w4_expand_kernel(x, w, b):  # the op: the Triton kernel on sm_89+ (its reference elsewhere)
        q = svdq(x, w, b)
        return lambda: torch.ops.dit_passes.w4_to_e4m3(q.qweight, q.wscale)

    def lrcat_act(x, w, b):  # the lrcat A operand alone, split: the op dit_passes::lrcat_quantize_rows
        q = svdq(x, w, b)
        c = lrcat_c(q.lora_down, q.K)
        return lambda: torch.ops.dit_passes.lrcat_quantize_rows(x, q.smooth_inv, q.lora_down, c, True)

    def lut_operands(x, w, b):
        q = svdq(x, w, b)
        return q, w4_lut.prepare_lut(q.qweight, q.wscale, q.lora_down, q.lora_up)

    def svdq_lut(act: str):
        # xd (and amax) by Inductor, then rows: h by mm, the A operand by the row kernel (the default); lowrank: the
        # A operand with h inside (dit_passes::lut_quantize_lowrank's kernel); the LUT GEMM
        def build(x, w, b):
            if not lut_available():
                return None
            q, lw = lut_operands(x, w, b)

            def smoothed(t):
                xd = (t.float() * q.smooth_inv).to(t.dtype)
                return (xd, w4_lut.token_amax(xd)) if act == "lowrank" else (xd, xd @ q.lora_down.t())
            prep = torch.compile(smoothed, backend=backend, fullgraph=True)
            bias = q.bias.to(torch.bfloat16) if q.bias is not None else None

            def run():
                xd, stat = prep(x)
                if act == "lowrank":
                    a8, sx = lut_act_triton.lut_quantize_lowrank(xd, stat, q.lora_down, lw.c, w4_lut.PLANES)
                else:
                    a8, sx = lrcat_quantize_smoothed(xd, stat, lw.c, planes=w4_lut.PLANES)
                return L.lut_gemm(lw.codes, lw.tables, a8, lw.sw, sx.view(-1), bias)
            return run
        return build

    def lut_gemm(config: str):  # the GEMM alone; checked against its reference before it is timed
        def build(x, w, b):
            if not lut_available():
                return None
            q, lw = lut_operands(x, w, b)
            a8, sx = w4_lut.lut_activation(x, q.smooth_inv, q.lora_down, lw.c, x.dtype, x.shape[0], q.rank)
            bias = q.bias.to(torch.bfloat16) if q.bias is not None else None
            out = L.lut_gemm(lw.codes, lw.tables, a8, lw.sw, sx, bias, config)
            ref = w4_lut.lut_gemm_reference(lw.codes, lw.tables, a8, lw.sw, sx, bias, torch.bfloat16)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            print(f"[lut_gemm {config}] {tuple(a8.shape)} x {tuple(lw.codes.shape)}: rel err vs reference {err:.2e}",
                  flush=True)
            if not err < 1e-2:
                raise RuntimeError(f"lut_gemm {config}: rel err {err} against its reference")
            return lambda: L.lut_gemm(lw.codes, lw.tables, a8, lw.sw, sx, bias, config)
        return build

    def lut_available() -> bool:  # asked only by the LUT designs: the first call may build the library
        return device.type == "cuda" and L.is_available()
    lut = {"svdq_lut": svdq_lut("rows"), "svdq_lut_lowrank": svdq_lut("lowrank"),
           **{f"w4a8_gemm_lut_{c}": lut_gemm(c) for c in L.CONFIGS},
           "svdq_lrcat_split_mm": svdq_fp8(True, "kernel", lrcat="split", act="mm")}
    return {**lut, "bf16_mm": bf16_mm, "fp8": fp8(False), "fp8_fast_accum": fp8(True), "fp8_gemm": fp8_gemm,
            "fp8_rowquant": fp8_rowquant, "fp8_act": fp8_act(False), "fp8_act_rowquant": fp8_act(True),
            "svdq_fp8": svdq_fp8(False), "svdq_fp8_fast_accum": svdq_fp8(True), "svdq_w4a8_fused": svdq_w4a8(False),
            "svdq_w4a8_fused_fold": svdq_w4a8(True), "w4a8_act": w4a8_parts("act"), "w4a8_gemm": w4a8_parts("gemm"),
            "w4a8_gemm_fold": w4a8_parts("gemm_fold"), "w4_expand": w4_expand, "w4_expand_kernel": w4_expand_kernel,
            "svdq_fp8_fast_accum_expandkernel": svdq_fp8(True, "kernel"), "svdq_lrcat": svdq_fp8(True, lrcat="plain"),
            "svdq_lrcat_expandkernel": svdq_fp8(True, "kernel", lrcat="plain"),
            "svdq_lrcat_split_expandkernel": svdq_fp8(True, "kernel", lrcat="split"), "lrcat_act": lrcat_act,
            "svdq_lrcat_split_act": svdq_fp8(True, "kernel", lrcat="split", act="kernel"), "svdq_op": svdq_op}


def clear_svdq() -> None:
    """Forget the current shape's SVDQuant weights (the next shape's are prepared on first use)."""
    _SVDQ.clear()


def w4a8_tile(design: str) -> Dict[str, str]:
    """``{"gemm_config": ...}``: the tile the W4A8 GEMM's autotuner chose on the design's last call (a fused design or
    its GEMM alone, on the GPU), else nothing."""
    if not (design.startswith("svdq_w4a8") or design.startswith("w4a8_gemm")) or not torch.cuda.is_available():
        return {}
    from dit_passes.quant import dispatch

    kernels = dispatch.w4a8_kernel_module()
    best = getattr(getattr(kernels, "_w4a8_gemm_tuned", None), "best_config", None)
    return {} if best is None else {"gemm_config": str(best)}
