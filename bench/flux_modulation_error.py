"""The AdaLN modulation linears' quantized forms at FLUX.1-dev widths: relative error of one transformer call, and the
weight bytes of the whole FLUX.1-dev transformer against bf16.

    .venv/bin/python bench/flux_modulation_error.py [--layers 2] [--single-layers 2] [--img 64] [--txt 16]

Error: ``FluxTransformer2DModel`` with the FLUX.1-dev configuration (``dit_passes.bench.FLUX_DEV``: hidden 3072, 24
heads, joint_attention_dim 4096) but ``--layers`` double and ``--single-layers`` single blocks, random weights
(``torch.manual_seed(0)``, diffusers' default init), fp32 on the CPU, one call on ``--img`` image and ``--txt`` text
tokens (``dit_passes.bench.flux_inputs``). Each config is ``compile_dit(model, passes=[SVDQuantW4A4(rank=32,
dynamic=True, ...)])``; the error is ``||out - ref|| / ||ref||`` against the unquantized fp32 call. Configs: every
block linear W4A4 with the modulation linears unquantized / W8A16 (the default) / W4A16 / W4A4, and the modulation
linears alone (``include=("modulation",)``) in W8A16 / W4A16: their own share of the error; the same two for
W4A16_LR (int4 residual + rank-32 low-rank branch). ``--only`` runs a subset of the error configs.

Bytes: the FLUX.1-dev transformer (19 + 38 blocks) on the meta device; each block linear's quantized tensors counted
from its shape with the formulas below (checked against the prepared tensors of a small linear), every other
tensor in bf16; the ratio is against the whole transformer in bf16. Writes ``<out>/<name>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

COMMAND = ".venv/bin/python bench/flux_modulation_error.py"
RANK = 32


def table_bytes(kind: str, n: int, k: int, bias: bool, rank: int = RANK) -> int:
    """Bytes of one linear [K -> N]'s quantized tensors, the activation dtype bf16 (the bias, SVDQuant's factors)."""
    b = 2 * n if bias else 0
    if kind == "bf16":
        return 2 * n * k + b
    if kind == "w8a16":       # int8 [N, K], fp32 row scales [N]
        return n * k + 4 * n + b
    if kind == "w4a16":       # packed int4 [N, K/2], bf16 group scales [N, K/64]
        return n * k // 2 + 2 * n * (k // 64) + b
    if kind == "w4a16_lr":    # + bf16 low-rank factors [r, K], [N, r]
        return n * k // 2 + 2 * n * (k // 64) + 2 * rank * (k + n) + b
    if kind == "svdq_w4a4":   # + bf16 low-rank factors [r, K], [N, r] and fp32 smoothing [K]
        return n * k // 2 + 2 * n * (k // 64) + 2 * rank * (k + n) + 4 * k + b
    raise ValueError(kind)


def check_formulas() -> None:
    """The formulas against the tensors the passes prepare (bf16 weight, a shape with K % 64 == 0)."""
    from dit_passes.quant import prepare_svdquant, prepare_w4a16, prepare_w4a16_lr, prepare_w8a16
    from dit_passes.quant.signature import place_tables

    w, b = torch.randn(96, 192, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    tabs = {"w8a16": prepare_w8a16(w, b).tensors(), "w4a16": prepare_w4a16(w, b).tensors(),
            "w4a16_lr": prepare_w4a16_lr(w, b, rank=8).tensors(),
            "svdq_w4a4": prepare_svdquant(w, b, rank=8, smooth="weight", dtype=w.dtype).tensors()}
    for kind, tab in tabs.items():
        tab = place_tables({"l": tab}, w)["l"]
        got = sum(t.numel() * t.element_size() for t in tab.values())
        want = table_bytes(kind, 96, 192, True, rank=8)
        assert got == want, (kind, got, want, {f: (t.dtype, tuple(t.shape)) for f, t in tab.items()})


def weight_bytes(modulation) -> dict:
    """The FLUX.1-dev transformer's bytes with every block linear SVDQuant W4A4 (rank 32) and the modulation linears
    in ``modulation`` (None: bf16), everything else bf16."""
    from dit_passes.bench import FLUX_DEV
    from dit_passes.models.zoo import model_class

    with torch.device("meta"):
        model = model_class("flux")(**FLUX_DEV)
    linears = {p: m for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = {p for p in linears if p.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    modulation_paths = {p for p in in_blocks if p.endswith(("norm1.linear", "norm1_context.linear", "norm.linear"))}
    by_kind: dict = {}
    covered = set()
    for p in in_blocks:
        m = linears[p]
        kind = (modulation or "bf16") if p in modulation_paths else "svdq_w4a4"
        by_kind[kind] = by_kind.get(kind, 0) + table_bytes(kind, m.out_features, m.in_features, m.bias is not None)
        covered |= {f"{p}.weight", f"{p}.bias"}
    rest = sum(2 * t.numel() for name, t in model.state_dict().items() if name not in covered)
    by_kind["bf16_other"] = rest
    bf16_total = sum(2 * t.numel() for t in model.state_dict().values())
    mod_bf16 = sum(table_bytes("bf16", linears[p].out_features, linears[p].in_features, True)
                   for p in modulation_paths)
    total = sum(by_kind.values())
    return {"modulation": modulation or "bf16", "bytes": total, "bf16_bytes": bf16_total,
            "ratio": total / bf16_total, "by_kind": by_kind, "modulation_bf16_bytes": mod_bf16,
            "modulation_share_of_bf16": mod_bf16 / bf16_total, "modulation_linears": len(modulation_paths),
            "block_linears": len(in_blocks)}


def relative_errors(layers: int, single: int, img: int, txt: int, only=None) -> dict:
    from dit_passes import compile_dit
    from dit_passes.bench import FLUX_DEV, flux_inputs
    from dit_passes.models.zoo import model_class
    from dit_passes.passes.quantize import SVDQuantW4A4

    config = dict(FLUX_DEV, num_layers=layers, num_single_layers=single)
    torch.manual_seed(0)
    model = model_class("flux")(**config).eval().requires_grad_(False)
    inputs = flux_inputs(config, img, txt, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ref = model(**inputs)[0]
    configs = {
        "all_w4a4_modulation_unquantized": dict(modulation=None),
        "all_w4a4_modulation_w8a16": dict(),  # the default
        "all_w4a4_modulation_w4a16": dict(modulation="w4a16"),
        "all_w4a4_modulation_w4a4": dict(modulation="svdq"),
        "modulation_only_w8a16": dict(include=("modulation",)),
        "modulation_only_w4a16": dict(include=("modulation",), modulation="w4a16"),
        "all_w4a4_modulation_w4a16_lr": dict(modulation="w4a16_lr"),
        "modulation_only_w4a16_lr": dict(include=("modulation",), modulation="w4a16_lr"),
    }
    if only:
        configs = {k: v for k, v in configs.items() if k in only}
    out = {}
    for name, kw in configs.items():
        t0 = time.perf_counter()
        compiled = compile_dit(model, passes=[SVDQuantW4A4(rank=RANK, dynamic=True, **kw)], keep_original=True)
        with torch.no_grad():
            y = compiled(**inputs)[0]
        counts = compiled._current().manager.records[-1].result.counts
        err = float((y.double() - ref.double()).norm() / ref.double().norm())
        out[name] = {"rel_err": err, "pass": dict(kw, rank=RANK, dynamic=True),
                     "kinds": {k[5:]: v for k, v in counts.items() if k.startswith("kind_")},
                     "bytes_before_fp32": counts["bytes_before"], "bytes_after": counts["bytes_after"],
                     "seconds": time.perf_counter() - t0}
        print(f"{name}: rel err {err:.5f} {out[name]['kinds']} ({out[name]['seconds']:.0f} s)", flush=True)
        del compiled, y
        gc.collect()
    return {"config": config, "img_tokens": img, "txt_tokens": txt, "dtype": "float32", "device": "cpu",
            "ref_norm": float(ref.norm()), "configs": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # two of each: block discovery needs a list of at least two blocks
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--single-layers", type=int, default=2)
    ap.add_argument("--img", type=int, default=64, help="image tokens (a square number)")
    ap.add_argument("--txt", type=int, default=16)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="flux_modulation_error")
    ap.add_argument("--only", nargs="+", default=None, help="run only these error configs (the bytes: every form)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    check_formulas()
    t0 = time.perf_counter()
    result = {
        "command": COMMAND + "".join(f" --{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                                     for k, v in vars(args).items()
                                     if v != ap.get_default(k)),
        "weights": {str(m): weight_bytes(m) for m in ("w8a16", "w4a16", "w4a16_lr", None)},
        "error": relative_errors(args.layers, args.single_layers, args.img, args.txt, args.only),
        "host": f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} thread(s)",
    }
    result["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = render_markdown(result)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def render_markdown(r: dict) -> str:
    e = r["error"]
    c = e["config"]
    lines = ["# AdaLN modulation linears quantized at FLUX.1-dev widths", "", f"Command: `{r['command']}`", "",
             f"## Relative error of one transformer call", "",
             f"FluxTransformer2DModel, FLUX.1-dev widths (hidden {c['num_attention_heads'] * c['attention_head_dim']}, "
             f"joint_attention_dim {c['joint_attention_dim']}) with {c['num_layers']} double + "
             f"{c['num_single_layers']} single block(s), random weights (seed 0, diffusers' init), {e['dtype']} on the "
             f"{e['device']}, {e['img_tokens']} image + {e['txt_tokens']} text tokens; `SVDQuantW4A4(rank={RANK}, "
             "dynamic=True, ...)`; error `||out - ref|| / ||ref||` against the unquantized call.", "",
             "| config | pass arguments | kinds | relative error |", "|---|---|---|---|"]
    for name, v in e["configs"].items():
        args = ", ".join(f"{k}={v!r}" for k, v in v["pass"].items() if k not in ("rank", "dynamic")) or "(default)"
        kinds = ", ".join(f"{k} {n}" for k, n in v["kinds"].items())
        lines.append(f"| {name} | {args} | {kinds} | {v['rel_err']:.5f} |")
    lines += ["", "## Weight bytes of the FLUX.1-dev transformer (19 double + 38 single blocks)", "",
              "Every block linear SVDQuant W4A4 rank 32 (int4 + bf16 group scales + bf16 low-rank factors + fp32 "
              "smoothing + bf16 bias), the modulation linears as below, everything else bf16; against the whole "
              "model in bf16.", "",
              "| modulation linears | bytes | bf16 bytes | ratio | by kind |", "|---|---|---|---|---|"]
    for v in r["weights"].values():
        kinds = ", ".join(f"{k} {n}" for k, n in v["by_kind"].items())
        lines.append(f"| {v['modulation']} | {v['bytes']} | {v['bf16_bytes']} | {v['ratio']:.4f} | {kinds} |")
    w = r["weights"]["w8a16"]
    lines += ["", f"The {w['modulation_linears']} modulation linears hold {w['modulation_bf16_bytes']} of the "
              f"{w['bf16_bytes']} bf16 bytes ({100 * w['modulation_share_of_bf16']:.1f}%).", "",
              f"Wall time {r['wall_s']:.0f} s on {r['host']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
