"""Time ``dit_passes::rms_norm_rope`` against Inductor's kernels for the same ATen ops, per form, on the GPU.

One q of FLUX.1-dev's single blocks at 1024² (4608 tokens, 24 heads of 128, bf16, fp32 cos / sin tables over the
tokens), in the three forms FuseNormRope takes: ``interleaved`` (aten.rms_norm, pairs (2j, 2j+1): FLUX),
``decomposed`` (diffusers' RMSNorm as ATen ops: HunyuanVideo), ``half_split`` (pairs (j, j + D/2) after diffusers'
RMSNorm: ACE-Step, Cosmos). Per form: the GPU time per call (``norm_rope_kernel._time_ms``: ``--iters`` calls
replayed in a CUDA graph, the launches' host time left out) of the op (its Triton kernel) and of ``torch.compile``
of the op's reference (the graph Inductor gets without the pass), the bytes each
must move (x, out and the tables once) as GB/s, and the max difference between the two outputs relative to the
reference's max (bf16 rounding: the kernel rounds once, the decomposed reference also before the weight). Writes
``--out`` (JSON) and prints a markdown table.

    python bench/norm_rope_forms.py --out bench/results/h100_norm_rope_forms.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

FORMS = {"interleaved": dict(decomposed=False, half_split=False),
         "decomposed": dict(decomposed=True, half_split=False),
         "half_split": dict(decomposed=True, half_split=True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="norm_rope_forms.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_rope_forms: needs a GPU (it times the op's Triton kernel against Inductor's)", file=sys.stderr)
        return 2
    from dit_passes.passes.norm_rope import rms_norm_rope_reference
    from norm_rope_kernel import _time_ms  # beside this script

    op = torch.ops.dit_passes.rms_norm_rope.default
    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, d = a.tokens, a.heads, a.head_dim
    x = torch.randn(1, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(d, device="cuda", generator=g).to(torch.bfloat16)
    cos = torch.randn(1, s, 1, d, device="cuda", generator=g)
    sin = torch.randn(1, s, 1, d, device="cuda", generator=g)
    moved = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    rows = []
    for name, flags in FORMS.items():
        args = ([x], [w], [1e-6], cos, sin, 1, flags["decomposed"], flags["half_split"])
        ref_fn = torch.compile(lambda *t: rms_norm_rope_reference(*t), fullgraph=True)
        ref, out = ref_fn(*args), op(*args)
        rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        t_op, t_ind = _time_ms(lambda: op(*args), a.iters), _time_ms(lambda: ref_fn(*args), a.iters)
        rows.append(dict(form=name, op_ms=t_op, inductor_ms=t_ind, op_gbps=moved / t_op / 1e6,
                         inductor_gbps=moved / t_ind / 1e6, speedup=t_ind / t_op, max_rel_diff=rel))
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=[1, s, h, d], iters=a.iters,
                rows=rows)
    with open(a.out, "w") as f:
        json.dump(info, f, indent=1)
    print(f"{info['device']}, q {info['shape']} bf16\n")
    print("| form | op ms | Inductor ms | op GB/s | Inductor GB/s | speedup | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['form']} | {r['op_ms']:.3f} | {r['inductor_ms']:.3f} | {r['op_gbps']:.0f} | "
              f"{r['inductor_gbps']:.0f} | {r['speedup']:.2f}x | {r['max_rel_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
