"""kernels/w4a4_cutlass.py + w4a4_cutlass_linear.py: validation, discovery, patching, build orchestration
and cache reuse, backend choice, and the Triton side kernels (interpreter) on CPU; the GEMM and the
linear against oracles on Hopper.

The CUDA tests need an sm_90 GPU, nvcc and the nvidia-cutlass headers (the first build takes minutes).
``DIT_PASSES_TEST_CUTLASS_BUILD=1`` additionally compiles the real library on a machine without a GPU
(nvcc + headers only); without nvcc or headers those tests skip.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import stat
import subprocess

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dit_passes.kernels import cutlass_build as B  # noqa: E402
from dit_passes.kernels import w4a4_cutlass as C  # noqa: E402
from dit_passes.kernels import w4a4_cutlass_linear as L  # noqa: E402
from dit_passes.quant import dispatch as D  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _cutlass_found() -> bool:
    try:
        C.find_cutlass_include()
        C.find_nvcc()
        return True
    except C.CutlassUnavailable:
        return False


def _inputs(M, N, K, device="cpu", c=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = K // 64
    a = torch.randint(-8, 8, (M, K), generator=g).float()
    w = torch.randint(-8, 8, (N, K), generator=g).float()
    asc = torch.rand(M, G, generator=g) * 0.1 + 0.01
    wsc = torch.rand(N, G, generator=g) * 0.1 + 0.01
    cc = torch.randn(M, N, generator=g).to(torch.bfloat16) if c else None
    dev = torch.device(device)
    return (a.to(torch.float8_e4m3fn).to(dev), C.group_major(asc.to(dev)), w.to(torch.float8_e4m3fn).to(dev),
            C.group_major(wsc.to(dev)), cc.to(dev) if cc is not None else None)


def _oracle(a, asc, w, wsc, c):
    M, K = a.shape
    G = K // 64
    a64 = a.double().cpu().view(M, G, 64)
    w64 = w.double().cpu().view(-1, G, 64)
    dots = torch.einsum("mgk,ngk->mng", a64, w64)
    out = (dots * asc.double().cpu()[:, None, :] * wsc.double().cpu()[None, :, :]).sum(-1)
    if c is not None:
        out = out + c.double().cpu()
    return out


# ------------------------------------------------------------------------------------------------ CPU
def test_is_available_never_raises():
    ok = C.is_available(build_if_needed=False)
    assert isinstance(ok, bool)
    if not torch.cuda.is_available():
        assert ok is False


def test_configs_match_the_cuda_source():
    src = open(C.SOURCE).read()
    entries = re.findall(r"^W4A4_ENTRY\((\w+),", src, flags=re.M)
    listed = re.search(r'w4a4_cutlass_configs\(\) \{ return "([^"]+)"', src).group(1).split(",")
    assert C.configs() == entries == listed
    assert C.configs() is not C.CONFIGS  # a copy


def test_cpu_tensors_raise_naming_the_device():
    a, asc, w, wsc, c = _inputs(8, 16, 128)
    with pytest.raises(ValueError, match="cpu"):
        C.w4a4_gemm_fp8(a, asc, w, wsc, c)


@pytest.mark.parametrize("which", ["a", "w", "ascale", "wscale", "c"])
def test_wrong_dtype_raises(which):
    a, asc, w, wsc, c = _inputs(8, 16, 128)
    args = dict(a_fp8=a, ascale=asc, w_fp8=w, wscale=wsc, c=c)
    key = {"a": "a_fp8", "w": "w_fp8"}.get(which, which)
    args[key] = args[key].to(torch.float16)
    with pytest.raises(ValueError, match=key):
        C.w4a4_gemm_fp8(**args)


def test_shape_and_layout_validation():
    a, asc, w, wsc, c = _inputs(8, 16, 128)
    with pytest.raises(ValueError, match="out_dtype"):
        C.w4a4_gemm_fp8(a, asc, w, wsc, c, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 64"):
        C.w4a4_gemm_fp8(a[:, :96].contiguous(), asc, w[:, :96].contiguous(), wsc)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        C.w4a4_gemm_fp8(a, asc, w[:8].contiguous(), wsc[:8])
    with pytest.raises(ValueError, match="K mismatch"):
        C.w4a4_gemm_fp8(a, asc, torch.zeros(16, 64, dtype=torch.float8_e4m3fn), wsc)
    with pytest.raises(ValueError, match="strides"):  # row-major [M, G] scales are rejected
        C.w4a4_gemm_fp8(a, asc.contiguous(), w, wsc)
    with pytest.raises(ValueError, match="shape"):
        C.w4a4_gemm_fp8(a, asc[:4], w, wsc)
    with pytest.raises(ValueError, match="c must have shape"):
        C.w4a4_gemm_fp8(a, asc, w, wsc, c[:4])
    with pytest.raises(ValueError, match="torch.Tensor"):
        C.w4a4_gemm_fp8(a.tolist(), asc, w, wsc)


def test_group_major_layout():
    s = torch.arange(12.0).view(4, 3)
    g = C.group_major(s)
    assert torch.equal(g, s) and g.stride() == (1, 4)
    assert C._is_group_major(g) and not C._is_group_major(s)
    assert C._is_group_major(torch.zeros(1, 5))  # a single row: any row stride
    assert C._is_group_major(torch.zeros(5, 1))  # a single group


def _fake_include(tmp_path):
    inc = tmp_path / "inc"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("")
    (inc / "cute" / "tensor.hpp").write_text("")
    return inc


def test_find_cutlass_include_env_override(tmp_path, monkeypatch):
    inc = _fake_include(tmp_path)
    monkeypatch.setenv("DIT_PASSES_CUTLASS_INCLUDE", str(inc))
    assert C.find_cutlass_include() == str(inc)


def test_find_cutlass_include_missing_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DIT_PASSES_CUTLASS_INCLUDE", str(tmp_path / "nope"))
    monkeypatch.delenv("CUTLASS_PATH", raising=False)
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: None)
    from importlib import metadata

    def _missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", _missing)
    with pytest.raises(C.CutlassUnavailable, match=re.escape("pip install nvidia-cutlass==4.2.0.0")):
        C.find_cutlass_include()


def test_find_cutlass_include_from_package_layout(tmp_path, monkeypatch):
    # the wheel layout: <site>/cutlass_library/source/include/{cutlass,cute}
    pkg = tmp_path / "site" / "cutlass_library"
    inc = pkg / "source" / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("")
    (inc / "cute" / "tensor.hpp").write_text("")
    monkeypatch.delenv("DIT_PASSES_CUTLASS_INCLUDE", raising=False)
    monkeypatch.delenv("CUTLASS_PATH", raising=False)

    class Spec:
        submodule_search_locations = [str(pkg)]

    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: Spec() if name == "cutlass_library" else None)
    assert C.find_cutlass_include() == str(inc)


def test_find_nvcc(tmp_path, monkeypatch):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert C.find_nvcc() == str(nvcc)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(B, "_NVCC_FALLBACKS", ())
    with pytest.raises(C.CutlassUnavailable, match="nvcc not found"):
        C.find_nvcc()


def test_header_patch(tmp_path):
    inc = _fake_include(tmp_path)
    hdr = inc / C._MAINLOOP
    hdr.parent.mkdir(parents=True, exist_ok=True)
    body = ("#pragma once\n"
            '  static_assert(ScalePromotionInterval % 4 == 0, "ScalePromotionInterval must be a multiple of 4.");\n'
            + "    if constexpr (ScalePromotionInterval != 4) {}\n" * 5)
    hdr.write_text(body)
    out = C._patched_header(str(inc))
    assert "W4A4_CUTLASS_PATCHED_SM90_BLOCKWISE" in out and "% 4 == 0" not in out
    assert out.count("ScalePromotionInterval != W4A4KBlocksPerTile") == 5
    hdr.write_text(body.replace("% 4 == 0", "% 8 == 0"))  # another CUTLASS version: refuse clearly
    with pytest.raises(C.CutlassUnavailable, match="cannot patch"):
        C._patched_header(str(inc))


@pytest.mark.skipif(not _cutlass_found(), reason="nvidia-cutlass headers / nvcc not installed")
def test_patch_applies_to_installed_cutlass():
    assert "W4A4_CUTLASS_PATCHED_SM90_BLOCKWISE" in C._patched_header(C.find_cutlass_include())


def _fake_toolchain(tmp_path, monkeypatch, calls):
    """A fake CUTLASS include dir, source and nvcc: C.build() runs its real orchestration, and the fake
    subprocess.run writes the objects / library it is asked for."""
    inc = _fake_include(tmp_path)
    hdr = inc / C._MAINLOOP
    hdr.parent.mkdir(parents=True, exist_ok=True)
    hdr.write_text("#pragma once\n" + C._PATCH[1][0] + "\n" + "if constexpr (ScalePromotionInterval != 4) {}\n" * 5)
    src = tmp_path / "k.cu"
    src.write_text("// source v1\n")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("DIT_PASSES_CUTLASS_INCLUDE", str(inc))
    monkeypatch.setenv("DIT_PASSES_CUTLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nocuda"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(B, "_NVCC_FALLBACKS", (str(nvcc),))
    monkeypatch.setattr(C, "LIBRARY", dataclasses.replace(C.LIBRARY, source=str(src)))

    def fake_run(cmd, **kw):
        calls.append(list(cmd))
        if "--version" in cmd:
            return subprocess.CompletedProcess(cmd, 0, "Cuda compilation tools\nBuild fake_13.0\n", "")
        out = cmd[cmd.index("-o") + 1]
        open(out, "w").write("obj" if "-c" in cmd else "lib")
        return subprocess.CompletedProcess(cmd, 0, "ptxas info    : Used 168 registers\n", "")

    monkeypatch.setattr(B.subprocess, "run", fake_run)
    return src, nvcc


def test_build_orchestration_and_cache_reuse(tmp_path, monkeypatch):
    calls = []
    src, nvcc = _fake_toolchain(tmp_path, monkeypatch, calls)
    so = C.build(jobs=2)
    compiles = [c for c in calls if "-c" in c]
    links = [c for c in calls if "-shared" in c]
    assert sorted(next(a for a in c if a.startswith("-DW4A4_CONFIG_INDEX=")) for c in compiles) == \
        [f"-DW4A4_CONFIG_INDEX={i}" for i in range(len(C.CONFIGS))]
    assert len(links) == 1 and all(c[-1] == str(src) for c in compiles)
    assert all("-I" + os.path.join(os.path.dirname(so), "patched_include") in c for c in compiles)
    d = os.path.dirname(so)
    assert sorted(os.listdir(d)) == ["build.json", "build.log", "command.txt", "patched_include", "w4a4_cutlass.so"]
    man = json.load(open(os.path.join(d, "build.json")))
    assert man["nvcc_version"] == "Build fake_13.0" and man["configs"] == C.CONFIGS and man["key"] == os.path.basename(d)
    assert C.built_library() == so
    n = len(calls)
    assert C.build() == so and not [c for c in calls[n:] if "-c" in c]  # reused, nothing compiled
    # another machine without nvcc: the same source/header/flags built elsewhere is found
    monkeypatch.setattr(B, "_NVCC_FALLBACKS", ())
    assert C.built_library() == so and C.build() == so
    src.write_text("// source v2\n")  # a changed source never reuses the old library
    assert C.built_library() is None
    with pytest.raises(C.CutlassUnavailable, match="nvcc not found"):
        C.build()


def test_build_failure_reports_the_log(tmp_path, monkeypatch):
    calls = []
    _fake_toolchain(tmp_path, monkeypatch, calls)
    real = B.subprocess.run

    def failing(cmd, **kw):
        if "-c" in cmd and "-DW4A4_CONFIG_INDEX=1" in cmd:
            return subprocess.CompletedProcess(cmd, 2, "", "k.cu(10): error: something broke\n")
        return real(cmd, **kw)

    monkeypatch.setattr(B.subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="something broke"):
        C.build()
    assert C.built_library() is None and not [c for c in calls if "-shared" in c]


_REAL_BUILD = os.environ.get("DIT_PASSES_TEST_CUTLASS_BUILD") == "1" and _cutlass_found()


@pytest.mark.skipif(not _REAL_BUILD, reason="set DIT_PASSES_TEST_CUTLASS_BUILD=1 (with nvcc + nvidia-cutlass) to compile")
def test_build_compiles():
    path = C.build(verbose=False)
    assert os.path.isfile(path)
    usage = C.resource_usage(path)
    assert set(usage) == set(C.CONFIGS)
    assert all(u["spill_stores"] == 0 and u["spill_loads"] == 0 for u in usage.values())
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    assert "torch" not in out and "libcudart.so" not in out and "libcuda.so" not in out  # plain C ABI, static cudart
    lib = ctypes.CDLL(path)  # loads without a GPU
    lib.w4a4_cutlass_configs.restype = ctypes.c_char_p
    assert lib.w4a4_cutlass_configs().decode().split(",") == C.CONFIGS
    assert lib.w4a4_cutlass_abi_version() == C.ABI_VERSION
    assert lib.w4a4_cutlass_set_scheduler(3, 0) != 0 and lib.w4a4_cutlass_set_scheduler(1, 0) == 0


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not HOPPER or not _cutlass_found(), reason="needs an sm_90 GPU, nvcc and nvidia-cutlass")
@pytest.mark.parametrize("config", C.CONFIGS)
@pytest.mark.parametrize("with_c", [False, True])
def test_gemm_matches_oracle(config, with_c):
    M, N, K = 200, 256, 192
    a, asc, w, wsc, c = _inputs(M, N, K, device="cuda", c=with_c)
    out = C.w4a4_gemm_fp8(a, asc, w, wsc, c, config=config)
    torch.cuda.synchronize()
    ref = _oracle(a, asc, w, wsc, c)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err
    # unit scales, no c: the integer dot must be exact (|d| <= 3 * 4096 fits bf16 only approximately,
    # so compare the bf16 rounding of the exact integer)
    ones_a = C.group_major(torch.ones(M, K // 64, device="cuda"))
    ones_w = C.group_major(torch.ones(N, K // 64, device="cuda"))
    exact = C.w4a4_gemm_fp8(a, ones_a, w, ones_w, None, config=config)
    dots = (a.float().cpu().double() @ w.float().cpu().double().T)
    assert torch.equal(exact.cpu(), dots.to(torch.bfloat16))


# ------------------------------------------------------------------ the CUTLASS linear's side kernels
try:
    from dit_passes.quant import int4 as Q
except ImportError:  # pragma: no cover
    Q = None
needs_ref = pytest.mark.skipif(Q is None, reason="dit_passes.quant not importable")


def _linear_args(M, K, N, r, dtype=torch.bfloat16, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype)
    x[1, :64] = 0  # a zero group (scale 1)
    si = torch.rand(K, generator=g) + 0.5
    qw, ws = Q.quantize_weight_w4(torch.randn(N, K, generator=g))
    ld = (torch.randn(r, K, generator=g) * 0.1).to(dtype)
    lu = (torch.randn(N, r, generator=g) * 0.1).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return [t.to(DEV) if t is not None else None for t in (x, qw, ws, ld, lu, si, b)]


@needs_ref
@pytest.mark.parametrize("dtype,r", [(torch.bfloat16, 8), (torch.float32, 0)])
def test_act_quant_e4m3_matches_reference(dtype, r):
    x, _, _, ld, _, si, _ = _linear_args(37, 192, 16, r, dtype)  # M not a multiple of the tile
    a8, asc, la = L.fused_act_quant_e4m3(x, si, ld, split_k=2)
    qx, asr, lar = Q.fused_act_quant_reference(x.cpu(), si.cpu(), ld.cpu())
    assert a8.dtype == torch.float8_e4m3fn and a8.shape == (37, 192)
    assert torch.equal(a8.cpu().float(), Q.unpack_int4(qx).float())  # exact int4 values
    assert asc.stride() == (1, 37) and torch.equal(asc.cpu(), asr)   # group-major, bit-exact scales
    assert la.shape == (37, r) and torch.allclose(la.cpu(), lar, rtol=1e-5, atol=1e-4)
    assert C._is_group_major(asc)


@needs_ref
def test_weight_unpack_every_byte_and_scale_layout():
    qw = torch.arange(256, dtype=torch.uint8).reshape(8, 32).repeat(6, 3)  # N=48, K=192: every byte
    ws = (torch.rand(48, 3) + 0.1).to(torch.bfloat16)
    w8, wsc = L.unpack_weight_e4m3(qw.to(DEV), ws.to(DEV))
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (48, 192)
    assert torch.equal(w8.cpu().float(), Q.unpack_int4(qw).float())
    assert wsc.stride() == (1, 48) and torch.equal(wsc.cpu(), ws.float())
    with pytest.raises(ValueError, match="K % 64"):
        L.unpack_weight_e4m3(qw[:, :48].to(DEV), ws.to(DEV))


@pytest.mark.parametrize("r,bias", [(8, True), (0, True), (8, False)])
def test_lowrank_up_bias(r, bias):
    g = torch.Generator().manual_seed(1)
    la = torch.randn(37, r, generator=g)
    lu = torch.randn(48, r, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16) if bias else None
    c = L.lowrank_up_bias(la.to(DEV) if r else None, lu.to(DEV) if r else None, b.to(DEV) if bias else None,
                          37, 48, DEV)
    ref = (la @ lu.float().T if r else torch.zeros(37, 48)) + (b.float() if bias else 0)
    assert c.dtype == torch.bfloat16
    tol = 0 if DEV == "cpu" else 2e-2  # tf32 on the GPU
    assert (c.cpu().float() - ref.to(torch.bfloat16).float()).abs().max().item() <= tol * ref.abs().max().item()
    assert L.lowrank_up_bias(None, None, None, 37, 48, DEV) is None


@needs_ref
@pytest.mark.parametrize("bias", [True, False])
def test_linear_pipeline_matches_reference(bias):
    """Side kernels + the torch version of the GEMM == the W4A4 reference up to bf16 rounding of c."""
    args = _linear_args(37, 192, 48, 8, bias=bias)
    out = L.w4a4_linear(*args, gemm=L.w4a4_gemm_fp8_reference)
    ref = Q.w4a4_linear_reference(*[t.cpu() if t is not None else None for t in args])
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    d = (out.cpu().float() - ref.float()).abs()
    assert d.max().item() <= 2 ** -6 * ref.float().abs().max().item()  # a bf16 ulp or two at most
    assert (d == 0).float().mean().item() > 0.5
    with pytest.raises(TypeError, match="bfloat16"):
        L.w4a4_linear(args[0].float(), *args[1:], gemm=L.w4a4_gemm_fp8_reference)


def test_weight_cache_opt_in():
    qw = torch.randint(0, 256, (16, 32), dtype=torch.uint8, device=DEV)
    ws = torch.ones(16, 1, dtype=torch.bfloat16, device=DEV)
    L.clear_weight_cache()
    assert L.weight_e4m3(qw, ws)[0] is not L.weight_e4m3(qw, ws)[0]  # default: unpacked per call
    w1, _ = L.weight_e4m3(qw, ws, cache=True)
    assert L.weight_e4m3(qw, ws, cache=True)[0] is w1
    qw.add_(1)  # an in-place update invalidates the entry
    w2, _ = L.weight_e4m3(qw, ws, cache=True)
    assert w2 is not w1 and torch.equal(w2.cpu().float(), Q.unpack_int4(qw.cpu()).float() if Q else w2.cpu().float())
    L.clear_weight_cache()


# ------------------------------------------------------------------------------------- backend choice
def test_backend_setting_and_table(tmp_path, monkeypatch):
    from dit_passes.infra import env
    # the op's backend argument: SVDQuantW4A4(form=...)'s kernel name, else the timing table's ("auto")
    assert [D.op_backend(f) for f in ("auto", "op", "triton", "cutlass", "lut")] == [
        "auto", "auto", "triton", "cutlass", "auto"]
    with pytest.raises(ValueError, match="backend must be one of"):
        D.check_op_backend("cublas")
    path = D.write_table([{"M": 4608, "N": 3072, "K": 3072, "backend": "cutlass", "config": "pingpong_64x128"},
                          {"M": 256, "N": 3072, "K": 3072, "backend": "triton"},
                          {"M": 4608, "N": 12288, "K": 3072, "backend": "bogus"}], str(tmp_path / "t.json"), device="x")
    monkeypatch.setenv(env.W4A4_TABLE, path)
    assert D.table_choice(4096, 3072, 3072) == "cutlass" and D.table_choice(300, 3072, 3072) == "triton"
    assert D.table_entry(8192, 3072, 3072) == (4608, "cutlass", "pingpong_64x128")
    assert D.table_choice(4608, 12288, 3072) is None and D.table_choice(4608, 64, 64) is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring"):
        assert D.table_choice(1, 1, 1, str(tmp_path / "bad.json")) is None
    monkeypatch.setenv(env.W4A4_TABLE, str(tmp_path / "missing.json"))
    assert D.table_choice(4608, 3072, 3072) is None
    # unset, the table sits beside the built libraries (a GPU run once found this path broken: only a machine
    # where the CUTLASS linear runs asked for it)
    monkeypatch.delenv(env.W4A4_TABLE)
    monkeypatch.setenv("DIT_PASSES_CUTLASS_CACHE", str(tmp_path / "cache"))
    assert D.table_path() == str(tmp_path / "cache" / "w4a4_backend_table.json")
    assert D.table_choice(4608, 3072, 3072) is None


def test_cpu_never_takes_the_cutlass_path():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    qw = torch.zeros(16, 64, dtype=torch.uint8)
    for setting in ("auto", "cutlass", "triton"):
        assert D.use_cutlass(x, qw, setting) is False
    assert not D.cutlass_supported(x, qw)


@needs_ref
def test_ops_module_discovery():
    mod = D.w4a4_cutlass_module()
    assert mod is not None and hasattr(D, "use_cutlass") and hasattr(mod, "w4a4_linear")


# ------------------------------------------------------------------------------------- GPU: the linear
@pytest.mark.skipif(not HOPPER or not _cutlass_found(), reason="needs an sm_90 GPU, nvcc and nvidia-cutlass")
@needs_ref
def test_cutlass_linear_matches_reference_and_dispatch():
    args = _linear_args(300, 256, 128, 16)
    ref = Q.w4a4_linear_reference(*args)
    out = L.w4a4_linear(*args)
    emu = L.w4a4_linear(*args, gemm=L.w4a4_gemm_fp8_reference)
    assert (out.float() - emu.float()).abs().max().item() <= 2 ** -7 * emu.float().abs().max().item()
    assert (out.float() - ref.float()).norm().item() <= 4e-3 * ref.float().norm().item()
    D.reset()
    assert D.use_cutlass(args[0], args[1], "cutlass")
    assert torch.equal(torch.ops.dit_passes.svdq_w4a4_linear(*args, "cutlass"), out)
