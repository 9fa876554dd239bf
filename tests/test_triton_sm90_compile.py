"""Our Triton kernels compile for sm_90 on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which runs them as Python and accepts code the compiler
rejects (stop 29: a plain global read inside a kernel failed every GPU test of its op, one device call lost). Triton
ships its compiler and ptxas, so a subprocess without the interpreter compiles each kernel the Hopper defaults run,
at one representative configuration, to a cubin for sm_90 (``triton.compile`` with a ``GPUTarget``; nothing runs).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# (module, kernel, pointer dtypes (the other arguments: i32 or the constexpr given), constexprs, num_warps)
KERNELS = [
    ("lrcat_act_triton", "_lrcat_stats_kernel",
     dict(x_ptr="*bf16", si_ptr="*fp32", ld_ptr="*bf16", amax_ptr="*fp32", h_ptr="*fp32"),
     dict(KS=1024, BK=64, R_PAD=128, DOT_F32=False, BF16=True, SOFT=False, BLOCK_M=128), 8),
    ("lrcat_act_triton", "_lrcat_quant_kernel",
     dict(x_ptr="*bf16", si_ptr="*fp32", amax_ptr="*fp32", h_ptr="*fp32", c_ptr="*fp32", a_ptr="*fp8e4nv",
          sx_ptr="*fp32"),
     dict(S=3, RH=128, R_PAD=128, SPLIT=True, COLS=384, SOFT=False, BLOCK_M=8, BK=512), 4),
    ("lrcat_act_triton", "_lrcat_rows_kernel",
     dict(x_ptr="*bf16", h_ptr="*bf16", c_ptr="*fp32", a_ptr="*fp8e4nv", sx_ptr="*fp32"),
     dict(BLOCK=4096, R_PAD=128, SPLIT=True, COLS=384, SOFT=False), 8),
    ("w4a16_rows_triton", "_w4a16_rows_kernel",
     dict(x_ptr="*bf16", qw_ptr="*u8", ws_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"),
     dict(KB=1536, M_PAD=2, HAS_BIAS=True, SOFT_BF16=False, BLOCK_N=8, BB=256), 8),
    ("w4_expand_triton", "_w4_expand_kernel",
     dict(qw_ptr="*u8", ws_ptr="*bf16", w16_ptr="*i16", w8_ptr="*fp8e4nv", sw_ptr="*fp32", lu_ptr="*bf16",
          c_ptr="*fp32"),
     dict(G=48, G_PAD=64, BLOCK_K=1024, LR=True, SPLIT=True, R_OUT=96, R_BLOCK=64, SOFT=False, GS=64, BLOCK_N=16), 8),
    ("fp8_rowquant_triton", "_rowquant_one_pass",
     dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(BLOCK=4096, SOFT=False), 8),
]


def _compile_all() -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for module, name, pointers, constexprs, warps in KERNELS:
        fn = getattr(importlib.import_module(f"dit_passes.kernels.{module}"), name)
        while not isinstance(fn, triton.runtime.jit.JITFunction):  # under @triton.autotune
            fn = fn.fn
        sig = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32") for p in fn.params}
        missing = [p for p, t in sig.items() if t == "constexpr" and p not in constexprs]
        assert not missing, f"{name}: constexprs {missing} need a value in KERNELS"
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert kernel.asm.get("cubin"), f"{name}: no cubin"
        print(f"{module}.{name}: {len(kernel.asm['cubin'])} bytes of sm_90 cubin", flush=True)


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "dit_passes_triton_sm90"))
    proc = subprocess.run([sys.executable, "-P", __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"a kernel does not compile for sm_90:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("sm_90 cubin") == len(KERNELS), proc.stdout


if __name__ == "__main__":
    _compile_all()
