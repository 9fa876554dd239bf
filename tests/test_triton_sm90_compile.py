"""Our Triton kernels compile for sm_90 on a machine without a GPU (``dit_passes.kernels.sm90_compile``).

The CPU tests run the kernels under TRITON_INTERPRET=1, which accepts code the compiler rejects (e.g. a plain
global read inside a kernel failed every GPU test of its op, one device call lost). A subprocess without the
interpreter compiles each kernel the Hopper defaults run, at one representative configuration, to a cubin for sm_90
(nothing runs), and reads ptxas's register count: no spills at those configurations.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _compile_all() -> None:
    from dit_passes.kernels.sm90_compile import KERNELS, compile_sm90, ptxas_resources

    for module, name, pointers, constexprs, warps in KERNELS:
        kernel = compile_sm90(module, name, pointers, constexprs, warps)
        assert kernel.asm.get("cubin"), f"{name}: no cubin"
        regs, spills = ptxas_resources(kernel.asm["ptx"])
        assert spills == 0, f"{name}: {spills} bytes of register spills at {constexprs}"
        print(f"{module}.{name}: sm_90 cubin of {len(kernel.asm['cubin'])} bytes, {regs} registers", flush=True)


def test_kernels_compile_for_sm90():
    from dit_passes.kernels.sm90_compile import KERNELS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "dit_passes_triton_sm90"))
    proc = subprocess.run([sys.executable, "-P", __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"a kernel does not compile for sm_90:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("sm_90 cubin") == len(KERNELS), proc.stdout


def test_compiling_under_the_interpreter_is_refused(monkeypatch):
    from dit_passes.kernels import sm90_compile

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        sm90_compile.jit_function("fp8_rowquant_triton", "_rowquant_one_pass")


if __name__ == "__main__":
    _compile_all()
