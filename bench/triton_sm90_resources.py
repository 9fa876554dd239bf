"""Registers and spills of our Triton kernels' autotune configurations on sm_90, from this machine (no GPU).

Triton's bundled ptxas reports what each configuration costs a thread (``dit_passes.kernels.sm90_compile``): a kernel
at 200+ registers (or 100+ KB of shared memory) runs a few warps an SM, which a bandwidth-bound kernel cannot afford
(e.g. a lrcat statistics kernel config at R_PAD 128: 255 registers, 149 KB). Compiled as the launcher
specializes FLUX's shapes (aligned pointers, integers divisible by 16). Prints a table; ``--out`` also writes JSON.

    env -u TRITON_INTERPRET python -P bench/triton_sm90_resources.py --out bench/results/triton_sm90_resources.json
"""
from __future__ import annotations

import argparse
import json
import os

from dit_passes.kernels.sm90_compile import KERNELS, compile_sm90, ptxas_resources


def sweep():
    """The autotune configs of the kernels that have them, each at the constexprs of :data:`KERNELS` otherwise."""
    import triton

    from dit_passes.kernels import lrcat_act_triton, w4_expand_triton, w4a16_rows_triton
    tuned = {"_lrcat_stats_kernel": lrcat_act_triton._lrcat_stats_kernel,
             "_lrcat_quant_kernel": lrcat_act_triton._lrcat_quant_kernel,
             "_w4a16_rows_kernel": w4a16_rows_triton._w4a16_rows_kernel,
             "_w4_expand_kernel": w4_expand_triton._w4_expand_kernel}
    variants = {"_lrcat_stats_kernel": [{"R_PAD": 32}, {"R_PAD": 128}], "_w4a16_rows_kernel": [{"M_PAD": 1}]}
    seen = set()
    for module, name, pointers, constexprs, warps in KERNELS:
        if name in seen:  # a kernel listed once per layout: its autotune configs cover them all
            continue
        seen.add(name)
        configs = tuned[name].configs if name in tuned else [triton.Config({}, num_warps=warps)]
        for extra in variants.get(name, [{}]):
            for cfg in configs:
                consts = {**constexprs, **extra, **cfg.kwargs}
                kernel = compile_sm90(module, name, pointers, consts, cfg.num_warps, cfg.num_stages)
                regs, spills = ptxas_resources(kernel.asm["ptx"])
                yield {"kernel": name, "config": {**cfg.kwargs, **extra}, "num_warps": cfg.num_warps,
                       "num_stages": cfg.num_stages, "registers": regs, "spill_bytes": spills,
                       "shared_bytes": kernel.metadata.shared}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for row in sweep():
        rows.append(row)
        print(f"{row['kernel']:22s} {json.dumps(row['config']):48s} warps {row['num_warps']:2d} stages "
              f"{row['num_stages']} | {row['registers']:3d} registers, {row['spill_bytes']:5d} B spilled, "
              f"{row['shared_bytes']:6d} B shared", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": "env -u TRITON_INTERPRET python -P bench/triton_sm90_resources.py --out "
                                  + args.out, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
