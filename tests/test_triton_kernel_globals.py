"""Every Triton kernel of ours reads module globals the compiler accepts.

The interpreter (TRITON_INTERPRET=1, the CPU tests' mode) runs a kernel as Python and reads any global; the compiler
takes only ``tl.constexpr`` globals, modules and other jitted functions. A plain ``GROUP_BYTES = 32`` read inside a
kernel passed every CPU test and failed every GPU compile: this test reads each kernel's names instead.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import dit_passes.kernels as kernels_pkg  # noqa: E402

TRITON_MODULES = [m.name for m in pkgutil.iter_modules(kernels_pkg.__path__) if m.name.endswith("_triton")]


def _python_function(obj):
    """The Python function under a jit / autotune / heuristics wrapper, or None for anything else."""
    seen = 0
    while hasattr(obj, "fn") and seen < 4:
        obj, seen = obj.fn, seen + 1
    return obj if seen and isinstance(obj, types.FunctionType) else None


def _kernels(module):
    for name, obj in vars(module).items():
        fn = _python_function(obj)
        if fn is not None and fn.__module__ == module.__name__:
            yield name, fn


def _names(code):
    """Global names a function's code reads, nested code objects (comprehensions, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def test_the_kernel_modules_are_found():
    assert {"w4a16_rows_triton", "lrcat_act_triton", "w4_expand_triton"} <= set(TRITON_MODULES)


@pytest.mark.parametrize("module_name", TRITON_MODULES)
def test_kernel_globals_are_constexpr(module_name):
    module = importlib.import_module(f"dit_passes.kernels.{module_name}")
    kernels = dict(_kernels(module))
    assert kernels, f"{module_name}: no jitted kernel found"
    bad = []
    for kname, fn in kernels.items():
        for name in sorted(_names(fn.__code__)):
            if name not in fn.__globals__:
                continue  # an attribute name (tl.load's "load") or a builtin
            value = fn.__globals__[name]
            if isinstance(value, (bool, int, float, str, tuple, list, dict)) and not isinstance(value, tl.constexpr):
                bad.append(f"{kname} reads {name} = {value!r}")
    assert not bad, f"{module_name}: globals the Triton compiler rejects (make them tl.constexpr): {bad}"
