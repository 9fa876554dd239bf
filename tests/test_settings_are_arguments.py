"""Settings that change the graph or the numerics are pass arguments: shown by ``describe()`` / ``explain()``, part of the
keys lowered graphs are cached under, chosen per device in one function (``dispatch.device_default``); the library
reads the environment in one module (``dit_passes/infra/env.py``), and only for build paths, tuning-table overrides,
debug logging and the test suite's trace reuse."""
from __future__ import annotations

import os
import re

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.backend import InductorPostGradPass
from dit_passes.infra import env
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import Fp8Linear, Int8Linear, SVDQuantW4A4
from dit_passes.quant import dispatch, lut_dispatch
from dit_passes.quant.forms import QuantForms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))
ENV_MODULE = os.path.join("dit_passes", "infra", "env.py")
READS = re.compile(r"os\.environ|getenv\(|environ\.get\(")
# the variables the quantized forms used to be chosen by: none is read any more
FORMER = ("DIT_PASSES_W4A4_BACKEND", "DIT_PASSES_W4_EXPAND", "DIT_PASSES_LRCAT_ACT", "DIT_PASSES_FP8_ACT_QUANT",
          "DIT_PASSES_WEIGHT_ONLY_FORM", "DIT_PASSES_LUT_PLANES", "DIT_PASSES_LUT_ACT", "DIT_PASSES_FP8_FAST_ACCUM")


def _library_sources():
    """(path relative to the repository, text) of every Python file of the package (kernels/ and patterns/, which
    the package maps as dit_passes.kernels / dit_passes.patterns, included once)."""
    for top in ("dit_passes", "kernels", "patterns"):
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d)) and d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    yield os.path.relpath(path, REPO), open(path).read()


def test_the_environment_is_read_in_one_module():
    readers = [p for p, text in _library_sources() if READS.search(text) and p != ENV_MODULE]
    assert readers == [], f"read the environment through dit_passes.infra.env instead: {readers}"
    ours = set(re.findall(r'"(DIT_PASSES_[A-Z0-9_]+)"', open(os.path.join(REPO, ENV_MODULE)).read()))
    assert ours == set(env.VARIABLES) and len(env.VARIABLES) <= 8
    # every DIT_PASSES_ name the library mentions (docstrings too) is one of them
    named = {m for _, text in _library_sources() for m in re.findall(r"DIT_PASSES_[A-Z0-9_]*[A-Z0-9]", text)}
    assert named <= set(env.VARIABLES), sorted(named - set(env.VARIABLES))
    design = open(os.path.join(REPO, "dit_passes", "DESIGN.md")).read()
    assert all(v in design for v in env.VARIABLES)  # listed there


def test_former_variables_change_nothing(monkeypatch):
    x = torch.zeros(1, 4, 128)
    q = torch.zeros(64, 64, dtype=torch.uint8)
    before = (dispatch.svdq_form(x, q), dispatch.fp8_fast_accum(), dispatch.fp8_act_quant("per_row", x),
              dispatch.w4_expand(x), dispatch.weight_only_form(x[:, :1]), lut_dispatch.lut_planes(),
              lut_dispatch.lut_act(x), lut_dispatch.svdq_lut(x.device))
    for name, value in zip(FORMER, ("fp8", "kernel", "stats", "kernel", "rows", "3", "lowrank", "0")):
        monkeypatch.setenv(name, value)
    after = (dispatch.svdq_form(x, q), dispatch.fp8_fast_accum(), dispatch.fp8_act_quant("per_row", x),
             dispatch.w4_expand(x), dispatch.weight_only_form(x[:, :1]), lut_dispatch.lut_planes(),
             lut_dispatch.lut_act(x), lut_dispatch.svdq_lut(x.device))
    assert after == before == ("op", True, "graph", "graph", "linear", 2, "graph", False)


@pytest.mark.parametrize("cap,want", [
    ((9, 0), dict(form="lut", fast_accum=True, act_quant="kernel", w4_expand="kernel", lrcat_act="mm",
                  weight_only_form="kernel", lut_planes=2, lut_act="rows")),
    ((8, 9), dict(form="op", act_quant="kernel", w4_expand="kernel", weight_only_form="kernel")),
    ((8, 0), dict(form="op", act_quant="graph", w4_expand="graph", weight_only_form="kernel")),
    (None, dict(form="op", fast_accum=True, act_quant="graph", w4_expand="graph", weight_only_form="linear")),
])
def test_device_defaults(cap, want):
    """The one table of per-device defaults: each "auto" / None field of QuantForms resolves by compute capability
    (None: no CUDA GPU); the weight-only default depends on the kind (int4: the GEMV kernel on a GPU)."""
    got = {name: dispatch.device_default(name, cap) for name in want}
    assert got == want
    assert dispatch.device_default("weight_only_form", cap, int4=False) == "linear"
    with pytest.raises(KeyError):
        dispatch.device_default("nope", cap)


def test_settings_are_shown_checked_and_key_the_caches():
    fast, exact = Fp8Linear(), Fp8Linear(fast_accum=False, act_quant="graph")
    assert "fast_accum" not in fast.describe() and "fast_accum=False, act_quant='graph'" in exact.describe()
    # the Inductor FX-graph cache key of the backend and the prepared-table key (both describe()) differ
    assert InductorPostGradPass([fast]).uuid() != InductorPostGradPass([exact]).uuid()
    lut = SVDQuantW4A4(rank=8, dynamic=True, form="lut", lut_planes=3)
    assert "form='lut', lut_planes=3" in lut.describe()
    assert QuantForms(form="lut", lut_planes=3).items() == {"form": "lut", "lut_planes": 3}
    # a setting the pass would not act on is refused, naming it (not accepted and dropped)
    for make, name in ((lambda: Fp8Linear("per_block", fast_accum=True), "fast_accum"),
                       (lambda: Fp8Linear("per_tensor", act_quant="kernel"), "act_quant"),
                       (lambda: Int8Linear(weight_only_form="rows"), "weight_only_form"),
                       (lambda: SVDQuantW4A4(rank=8, dynamic=True, form="op", lut_planes=2), "lut_planes"),
                       (lambda: SVDQuantW4A4(rank=8, dynamic=True, form="w4a8", act_quant="kernel"), "act_quant"),
                       (lambda: SVDQuantW4A4(rank=8, dynamic=True, precision="nvfp4", form="lut"), "form"),
                       (lambda: SVDQuantW4A4(rank=8, dynamic=True, modulation=None, weight_only_form="rows"),
                        "weight_only_form")):
        with pytest.raises(ValueError, match=f"{name}=.* has no effect here"):
            make()
    with pytest.raises(ValueError, match="form must be one of"):
        SVDQuantW4A4(rank=8, dynamic=True, form="fp16")
    with pytest.raises(ValueError, match="lut_planes must be one of"):
        QuantForms(lut_planes=4)


def test_op_kernel_argument_in_the_graph_and_explain():
    """``form="triton"``: the W4A4 op is written with its kernel as an argument (the CUDA implementation takes it;
    on the CPU the reference, the same numbers as ``form="op"``); explain() shows the setting."""
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    op = torch.ops.dit_passes.svdq_w4a4_linear.default

    def lowered(form):
        return compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, form=form)], example_inputs=kw,
                           keep_original=True)
    triton, plain = lowered("triton"), lowered("op")
    calls = [n for n in triton.graph_module.graph.nodes if n.target is op]
    assert calls and all(n.args[-1] == "triton" for n in calls)
    assert all(len(n.args) == 7 for n in plain.graph_module.graph.nodes if n.target is op)  # the default: "auto"
    assert "form='triton'" in triton.explain(print_output=False)
    assert "form='op'" in plain.explain(print_output=False)
    with torch.no_grad():
        assert torch.equal(triton(**kw)[0], plain(**kw)[0])
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.use_cutlass(kw["hidden_states"], torch.zeros(4, 4, dtype=torch.uint8), "cublas")
