"""The W4A8 Triton kernels (kernels/w4a8_triton.py) built for sm_90 on a machine without a GPU: registers, spills
and the GEMM main loop's instruction mix (SASS), per tile configuration.

Triton compiles for a target given explicitly (``GPUTarget("cuda", 90, 32)``); its bundled ptxas / cuobjdump
assemble and disassemble. The arguments are specialised as the JIT specialises FLUX's (every pointer, size and
stride divisible by 16): without that hint Triton does not pipeline the loads (no cp.async). What this shows, and a
GPU timing cannot: whether the loop is pipelined (``LDGSTS``), which MMA runs (``QGMMA`` = fp8 wgmma), where the
wgmma waits sit (``WARPGROUP.DEPBAR``) and how many ALU instructions the weight conversion costs per K-group::

    python bench/w4a8_sm90_build.py                 # the autotune list, both scale modes
    python bench/w4a8_sm90_build.py --sass 256,128,64,8,3,0 --fold
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # a real build, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dit_passes.kernels import w4a8_triton as K  # noqa: E402
from dit_passes.kernels.w4a4_autotune import w4a8_gemm_configs  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
GEMM_TYPES = dict(qx_ptr="*fp8e4nv", sx_ptr="*fp32", qw_ptr="*u8", ws_ptr="*bf16", sw_ptr="*fp32", la_ptr="*fp32",
                  lu_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32", R="i32",
                  M_BUCKET="i32", s_qxm="i32", s_qwn="i32", s_wsn="i32", s_lam="i32", s_lun="i32", s_om="i32")
ACT_TYPES = dict(x_ptr="*bf16", si_ptr="*fp32", ld_ptr="*bf16", q_ptr="*fp8e4nv", sx_ptr="*fp32", la_ptr="*fp32",
                 M="i32", K="i32", R="i32", M_BUCKET="i32", s_xm="i32", s_qm="i32", s_ldr="i32", s_lam="i32")


def build(fn, types, consts, num_warps, num_stages):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in types})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                 num_stages=num_stages))


def sass(ptx: str) -> tuple:
    """(ptxas -v summary, SASS text) of a PTX module."""
    with tempfile.TemporaryDirectory() as d:
        p, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(p, "w") as f:
            f.write(ptx)
        info = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", p, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        text = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} B spilled", text


def main_loop(text: str) -> list:
    """The instructions of the largest backward-branch loop holding an MMA (the K loop)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    best: list = []
    for addr, txt in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("MMA" in t for t in body) and len(body) > len(best):
                best = body
    return best


def mix(body: list) -> str:
    ops = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
    return f"{len(body)} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", help="print the main loop of this GEMM config: BLOCK_M,BLOCK_N,BLOCK_K,warps,stages,"
                                   "PREFETCH")
    ap.add_argument("--fold", action="store_true", help="with --sass: the folded-scale kernel")
    args = ap.parse_args(argv)
    if args.sass:
        bm, bn, bk, w, s, pf = (int(v) for v in args.sass.split(","))
        cfgs = [(args.fold, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PREFETCH=pf), w, s)]
    else:
        cfgs = [(fold, dict(c.kwargs), c.num_warps, c.num_stages) for fold in (False, True)
                for c in w4a8_gemm_configs() if fold or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    for fold, cfg, w, s in cfgs:
        consts = dict(TRIP=0, HAS_LORA=True, HAS_BIAS=True, R_PAD=32, FOLD=fold, SOFT=False, LORA_IEEE=False, **cfg)
        ck = build(K._w4a8_gemm_kernel, GEMM_TYPES, consts, w, s)
        summary, text = sass(ck.asm["ptx"])
        loop = main_loop(text)
        print(f"gemm fold={int(fold)} {cfg} warps={w} stages={s}: {summary}, shared {ck.metadata.shared} B; "
              f"main loop {mix(loop)}")
        if args.sass:
            print("\n".join(loop))
    if not args.sass:
        for bm, w in ((16, 4), (32, 8)):
            consts = dict(TRIP=0, HAS_LORA=True, R_PAD=32, DOT_F32=False, SOFT=False, CHUNK=256, BLOCK_M=bm)
            ck = build(K._w4a8_act_kernel.fn, ACT_TYPES, consts, w, 3)
            print(f"act BLOCK_M={bm} warps={w} CHUNK=256: {sass(ck.asm['ptx'])[0]}, shared {ck.metadata.shared} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
