"""AdaLN's LayerNorm + modulation kernel (``dit_passes::layer_norm_modulate``) on FLUX.1-dev's shapes, on one GPU.

Times the Triton kernel's launch choices (rows per program x warps) against Inductor compiling the same ATen ops
(``F.layer_norm(h) * (1 + scale) + shift``, with ``h = r + gate * y`` in the residual case), each as GPU time in a
replayed CUDA graph (``bench/norm_rope_kernel.py``'s ``_time_ms``): a single block's input norm (4608 tokens x
3072, bf16) and a double block's second norm after its gated residual (4096 x 3072). GB/s counts the row tensors'
reads and writes once.

    python bench/ln_modulate_kernel.py --out $OUT      # writes ln_modulate_kernel.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from norm_rope_kernel import _time_ms  # noqa: E402


def _plain(x, m, a):
    return F.layer_norm(x, [x.shape[-1]], None, None, 1e-6) * m + a


def _residual(r, g, y, m, a):
    h = r + g * y
    return h, F.layer_norm(h, [h.shape[-1]], None, None, 1e-6) * m + a


def main() -> int:
    from dit_passes.kernels import ln_modulate_triton as k

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out/ln_modulate_kernel")
    a = p.parse_args()
    dev, dt, d = "cuda", torch.bfloat16, 3072
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case, n in (("single_input_norm", 4608), ("double_residual_norm", 4096)):
        g = torch.Generator(device=dev).manual_seed(0)
        y, r = (torch.randn(1, n, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        gate, m, sh = (torch.randn(1, 1, d, device=dev, dtype=dt, generator=g) for _ in range(3))
        resid = case.startswith("double")
        gb = (4 if resid else 2) * y.numel() * y.element_size() / 1e9
        fn = torch.compile(_residual if resid else _plain)
        args = (r, gate, y, m, sh) if resid else (y, m, sh)
        ref = fn(*args)
        rows = {"inductor": _time_ms(lambda: fn(*args))}
        out, h = torch.empty_like(y), torch.empty_like(y)

        def ours(nr, nw):
            k.layer_norm_modulate_into(y, None, None, 1e-6, m, sh, out, residual=r if resid else None,
                                       gate=gate if resid else None, h_out=h if resid else None,
                                       rows=nr, num_warps=nw)
        errs = []
        for nr in (1, 2, 4):
            for nw in (4, 8, 16):
                ours(nr, nw)
                want = ref[1] if resid else ref
                errs.append(((out.float() - want.float()).abs().max() / want.float().abs().max()).item())
                rows[f"rows{nr}_warps{nw}"] = _time_ms(lambda: ours(nr, nw))
        res["cases"][case] = {"gb": gb, "ms": rows, "gbps": {kk: gb / (v / 1e3) for kk, v in rows.items()},
                              "max_rel_err_vs_inductor": max(errs)}
        best = min((v, kk) for kk, v in rows.items())
        default = rows[f"rows{k.ROWS}_warps{k.WARPS}"]
        print(case, f"best {best[1]} {best[0] * 1e3:.1f} us ({gb / (best[0] / 1e3):.0f} GB/s); inductor "
              f"{rows['inductor'] * 1e3:.1f} us; default {default * 1e3:.1f} us; max rel err {max(errs):.2e}",
              flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ln_modulate_kernel.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
