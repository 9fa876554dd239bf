"""Our Triton kernels compiled for sm_90 without a GPU: compile errors and register use seen on the CPU.

Triton ships its compiler and ptxas, so ``triton.compile`` with a ``GPUTarget`` makes a Hopper cubin on any machine
(nothing runs). The CPU tests run the kernels under TRITON_INTERPRET=1, which accepts code the compiler rejects (stop
29: a plain global read inside a kernel failed every GPU test of its op); ``tests/test_triton_sm90_compile.py``
compiles :data:`KERNELS` in a process without the interpreter. :func:`ptxas_resources` reads ptxas's register and
spill counts, which decide a kernel's occupancy (``bench/triton_sm90_resources.py`` prints them per autotune config).

Must run where ``TRITON_INTERPRET`` is unset when triton is imported (``@triton.jit`` then makes compilable
functions).
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
from typing import Dict, Optional, Tuple

import triton

from dit_passes.infra import env

# (module, kernel, pointer dtypes (the other arguments: i32 or the constexpr given), constexprs, num_warps): the
# kernels the Hopper defaults run, each at one representative configuration (FLUX-sized where a size is a constexpr)
KERNELS = [
    ("lrcat_act_triton", "_lrcat_stats_kernel",
     dict(x_ptr="*bf16", si_ptr="*fp32", ld_ptr="*bf16", amax_ptr="*fp32", h_ptr="*fp32"),
     dict(KS=1024, BK=32, R_PAD=128, DOT_F32=False, BF16=True, SOFT=False, BLOCK_M=64), 8),
    ("lrcat_act_triton", "_lrcat_quant_kernel",
     dict(x_ptr="*bf16", si_ptr="*fp32", amax_ptr="*fp32", h_ptr="*fp32", c_ptr="*fp32", a_ptr="*fp8e4nv",
          sx_ptr="*fp32"),
     dict(S=3, RH=128, R_PAD=128, SPLIT=True, COLS=384, SOFT=False, BLOCK_M=8, BK=512), 4),
    ("lrcat_act_triton", "_lrcat_rows_kernel",
     dict(x_ptr="*bf16", h_ptr="*bf16", c_ptr="*fp32", a_ptr="*fp8e4nv", sx_ptr="*fp32"),
     dict(BLOCK=4096, R_PAD=128, SPLIT=True, COLS=384, SOFT=False, PLANES=0), 4),
    # the LUT GEMM's A operand (planes [hi | hi / 16 | lo]) at FLUX's fused rank 128
    ("lrcat_act_triton", "_lrcat_rows_kernel",
     dict(x_ptr="*bf16", h_ptr="*bf16", c_ptr="*fp32", a_ptr="*fp8e4nv", sx_ptr="*fp32"),
     dict(BLOCK=4096, R_PAD=128, SPLIT=False, COLS=384, SOFT=False, PLANES=3), 4),
    # ... and with the down projection inside (lut_act_triton), at FLUX's fused rank 128, three splits of 1024
    ("lut_act_triton", "_lowrank_quant_kernel",
     dict(x_ptr="*bf16", amax_ptr="*fp32", ld_ptr="*bf16", a_ptr="*fp8e4nv", h_ptr="*fp32"),
     dict(KS=1024, R_PAD=128, DOT_F32=False, SOFT=False, BLOCK_M=32, BK=128), 8),
    ("lut_act_triton", "_lowrank_branch_kernel",
     dict(h_ptr="*fp32", amax_ptr="*fp32", c_ptr="*fp32", a_ptr="*fp8e4nv", sx_ptr="*fp32"),
     dict(S=3, RH=128, W_PAD=128, COLS=384, PLANES=3, SOFT=False, BLOCK_M=16), 4),
    ("w4a16_rows_triton", "_w4a16_rows_kernel",
     dict(x_ptr="*bf16", qw_ptr="*u8", ws_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"),
     dict(KB=1536, M_PAD=2, HAS_BIAS=True, SOFT_BF16=False, BLOCK_N=8, BB=256, GC=1, GROUPED=False), 8),
    ("w4a16_rows_triton", "_w4a16_rows_kernel",
     dict(x_ptr="*bf16", qw_ptr="*u8", ws_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"),
     dict(KB=1536, M_PAD=2, HAS_BIAS=True, SOFT_BF16=False, BLOCK_N=16, BB=32, GC=8, GROUPED=True), 8),
    ("w4_expand_triton", "_w4_expand_kernel",
     dict(qw_ptr="*u8", ws_ptr="*bf16", w16_ptr="*i16", w8_ptr="*fp8e4nv", sw_ptr="*fp32", lu_ptr="*bf16",
          c_ptr="*fp32"),
     dict(G=48, G_PAD=64, BLOCK_K=1024, LR=True, SPLIT=True, R_OUT=96, R_BLOCK=64, SOFT=False, GS=64, WORDS=False,
          BLOCK_N=16), 8),
    ("w4_expand_triton", "_w4_expand_kernel",
     dict(qw_ptr="*i32", ws_ptr="*bf16", w16_ptr="*i64", w8_ptr="*fp8e4nv", sw_ptr="*fp32", lu_ptr="*bf16",
          c_ptr="*fp32"),
     dict(G=48, G_PAD=64, BLOCK_K=1024, LR=True, SPLIT=True, R_OUT=96, R_BLOCK=64, SOFT=False, GS=64, WORDS=True,
          BLOCK_N=16), 8),
    ("fp8_rowquant_triton", "_rowquant_one_pass",
     dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(BLOCK=4096, SOFT=False), 4),
    ("norm_rope_triton", "_rms_norm_rope",
     dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16", eps="fp32"),
     dict(HAS_W=True, BLOCK_R=8, HALF_D=64, SOFT_BF16=False, HALF_SPLIT=False), 2),
    ("norm_rope_triton", "_rms_norm_rope",
     dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16", eps="fp32"),
     dict(HAS_W=True, BLOCK_R=8, HALF_D=64, SOFT_BF16=False, HALF_SPLIT=True), 2),
    # the norm over all heads of Wan 2.1 14B (40 heads of 128)
    ("norm_rope_triton", "_rms_norm_rope_grouped",
     dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16", eps="fp32"),
     dict(H=40, HAS_W=True, BLOCK_R=8, HALF_D=64, SOFT_BF16=False), 2),
]


def jit_function(module: str, name: str) -> "triton.runtime.jit.JITFunction":
    """The JITFunction of ``dit_passes.kernels.<module>.<name>`` (under its autotune / heuristics wrappers)."""
    if env.triton_interpret():
        raise RuntimeError("compile for sm_90 in a process without TRITON_INTERPRET (it makes interpreted kernels)")
    fn = getattr(importlib.import_module(f"dit_passes.kernels.{module}"), name)
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn
    return fn


def compile_sm90(module: str, name: str, pointers: Dict[str, str], constexprs: Dict[str, object], num_warps: int,
                 num_stages: Optional[int] = None):
    """A cubin for sm_90 of one kernel at one configuration: Triton's ``CompiledKernel`` (``.asm`` holds ttir, ttgir,
    ptx, cubin). Raises the compiler's error for code it rejects."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = jit_function(module, name)
    sig = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32") for p in fn.params}
    missing = [p for p, t in sig.items() if t == "constexpr" and p not in constexprs]
    if missing:
        raise ValueError(f"{name}: the constexprs {missing} need values")
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    # as the launcher specializes a call with FLUX's shapes: every pointer 16-byte aligned, every integer argument a
    # multiple of 16 (what lets the compiler vectorize loads and stores)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if not p.is_constexpr}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_resources(ptx: str) -> Tuple[int, int]:
    """(registers a thread, bytes of spill stores) that Triton's bundled ptxas reports for a kernel's PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True,
                             check=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)), int(spills.group(1)) if spills else 0
