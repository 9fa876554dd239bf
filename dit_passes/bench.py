"""``dit-passes bench``: the residual cache's step times against the uncached transformer.

Runs the zoo's Flux transformer class through a toy 28-step Euler loop (the timestep falls, the latents move with
the output) under the same forced schedules for every system: threshold 0 (never cache) and "always
cache after 8 warm-up steps" (threshold >= 1). Rows:

* ``eager``: the original transformer;
* ``graph``: ``compile_dit(model, passes=[])`` (the captured graph, no cache);
* ``dbcache_never`` / ``dbcache_always``: ``compile_dit`` with ``DBCache(F8B0, W8)``, eagerly;
* ``compiled_*``: the same graphs through ``compile_dit(..., torch_compile={...})`` (Inductor), with the
  first generation's time (compile included) and the steady 28-step time;
* ``compiled_regional_never`` / ``compiled_regional_always``: ``dbcache_*`` with ``torch_compile={"regional":
  True, ...}`` (``passes.RegionalCompile``: one Inductor compile per distinct block program, the rest eager);
* ``graphed_regional_always``: ``compiled_regional_always`` with ``"mode": "reduce-overhead"``: the whole step
  replayed as one CUDA graph, the cache decision a conditional node (no host read per step);
  ``graphed_regional_epilogue_always``: the same plus ``SplitConcatLinear`` and ``FuseLinearGelu`` (still bf16);
  ``graphed_regional_epilogue_rope_always``: that plus ``FuseNormRope`` (the q / k RMSNorm and rotary embedding
  as one op); ``graphed_regional_fp8_rope_always``: the fp8 row below plus ``FuseNormRope``;
  ``graphed_regional_{epilogue,fp8}_pointwise_always``: the two ``_rope`` rows plus ``FuseNormModulate`` (AdaLN's
  LayerNorm + modulation, and the gated residual before it, as one op);
  ``graphed_regional_fp8_always``: the same plus ``FuseSiblingLinears`` and ``Fp8Linear`` on every block linear
  (``Fp8Linear(fast_accum=True, act_quant="kernel")``: fast accumulation, activations quantized by our row
  kernel); it releases the bf16 block weights, so it runs last;
  ``compiled_regional_fp8_always``: the fp8 stack with the step eager (where no CUDA-graph IF nodes exist);
* ``--preset fastest``: ``compiled_regional_always,graphed_regional_epilogue_pointwise_always,
  graphed_regional_fp8_pointwise_always``;
* ``--attention cudnn`` adds ``passes.AttentionBackend("cudnn")`` to every captured row (not ``eager``);
* host time of capture + passes.

``--size full`` is the FLUX.1-dev configuration (11.9 B parameters, random bf16 weights, 1024² image =
4096 tokens + 512 text tokens) for a GPU; ``--size tiny`` a small model that runs on a CPU in seconds.
Results go to ``--out`` as JSON (written after every row, so a partial run keeps what it measured).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=14, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))
SIZES = {"full": (FLUX_DEV, 4096, 512), "tiny": (TINY, 256, 32)}
STEPS, WARMUP = 28, 8
ROWS = ("eager", "graph", "dbcache_never", "dbcache_always", "compiled_graph", "compiled_never", "compiled_always",
        "compiled_regional_never", "compiled_regional_always", "compiled_regional_fp8_always",
        "graphed_regional_always", "graphed_regional_epilogue_always", "graphed_regional_fp8_always",
        "graphed_regional_epilogue_rope_always", "graphed_regional_fp8_rope_always",
        "graphed_regional_epilogue_pointwise_always", "graphed_regional_fp8_pointwise_always")
PRESETS = {"fastest": "compiled_regional_always,graphed_regional_epilogue_pointwise_always,"
                      "graphed_regional_fp8_pointwise_always"}


def build_model(size: str, device: torch.device, dtype: torch.dtype):
    from .models.zoo import model_class
    torch.manual_seed(0)
    with torch.device(device):
        return model_class("flux")(**SIZES[size][0]).to(dtype).eval().requires_grad_(False)


def make_inputs(size: str, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    config, img, txt = SIZES[size]
    return flux_inputs(config, img, txt, device, dtype)


def flux_inputs(config: Dict[str, Any], img: int, txt: int, device: torch.device, dtype: torch.dtype
                ) -> Dict[str, Any]:
    """One FLUX call (batch 1): ``img`` image tokens on a square grid, ``txt`` text tokens, seeded random latents
    and embeddings, guidance 3.5."""
    g = torch.Generator(device=device).manual_seed(0)
    side = int(img ** 0.5)
    ids = torch.zeros(side, side, 3, device=device)
    ids[..., 1] = torch.arange(side, device=device)[:, None]
    ids[..., 2] = torch.arange(side, device=device)[None, :]
    return dict(hidden_states=torch.randn(1, img, config["in_channels"], device=device, dtype=dtype, generator=g),
                encoder_hidden_states=torch.randn(1, txt, config["joint_attention_dim"], device=device, dtype=dtype,
                                                  generator=g),
                pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype,
                                               generator=g),
                timestep=torch.tensor([1.0], device=device, dtype=dtype),
                guidance=torch.tensor([3.5], device=device, dtype=dtype),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3, device=device), return_dict=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generation(model, inputs: Dict[str, Any], steps: int = STEPS) -> float:
    """Seconds for one ``steps``-step toy generation (host clock after a device sync)."""
    return generation_latents(model, inputs, steps)[0]


def generation_latents(model, inputs: Dict[str, Any], steps: int = STEPS):
    """``(seconds, final latents)`` of one ``steps``-step toy generation (:func:`generation`'s loop)."""
    device = inputs["hidden_states"].device
    kw = dict(inputs)
    timesteps = [torch.tensor([1.0 - i / steps], device=device, dtype=inputs["timestep"].dtype) for i in range(steps)]
    _sync(device)
    t0 = time.perf_counter()
    x = kw["hidden_states"]
    with torch.inference_mode():
        for t in timesteps:
            kw["timestep"] = t
            out = model(**kw)[0]
            x = x + 0.01 * out
            kw["hidden_states"] = x
    _sync(device)
    return time.perf_counter() - t0, x


def schedules() -> Dict[str, Dict[str, Any]]:
    # cache-dit's defaults F8B0 / W8, thresholds forced so every system caches the same steps
    return {"never": dict(Fn_compute_blocks=8, max_warmup_steps=WARMUP, residual_diff_threshold=0.0),
            "always": dict(Fn_compute_blocks=8, max_warmup_steps=WARMUP, residual_diff_threshold=1.5)}


def row_factories(model, inputs, compile_kwargs: Dict[str, Any],
                  attention: Optional[str] = None) -> Dict[str, Callable[[], Any]]:
    from . import compile_dit, passes
    s = schedules()
    ex = {k: v for k, v in inputs.items()}
    regional = {**compile_kwargs, "regional": True}

    graphed = {**regional, "mode": "reduce-overhead"}

    def make(schedule: Optional[str], torch_compile: Optional[Dict[str, Any]] = None, fp8: bool = False,
             epilogue: bool = False, rope: bool = False, modulate: bool = False):
        def build():
            chosen = ([passes.DBCache(**s[schedule])] if schedule else []) + (
                [passes.AttentionBackend(attention)] if attention else [])
            if epilogue:  # still bf16: the concatenated copy before proj_out and the GELU kernels gone
                chosen += [passes.SplitConcatLinear(), passes.FuseLinearGelu()]
            if fp8:
                # one read per activation in our row kernel: less GPU time, but ~300 more Python calls a step,
                # which only a CUDA-graph replay hides (faster graphed, slower eager on an H100:
                # bench/results/fastest_stack_fp8_forms_h100.md); sm_90's fast fp8 accumulation in both
                act_quant = "kernel" if torch_compile is graphed else "auto"
                # q / k / v (and a single block's proj_mlp) as one linear: one activation quantization, one wider
                # GEMM (faster on the H100 fp8 step: bench/results/quant_step_fused_h100.md)
                chosen += [passes.FuseSiblingLinears(),
                           passes.Fp8Linear(exclude=(), fast_accum=True, act_quant=act_quant)]
            if rope:  # lossless: one read and one write of q and k between their GEMM and attention
                chosen += [passes.FuseNormRope()]
            if modulate:  # lossless: AdaLN's norm + modulation (+ the gated residual) read and written once
                chosen += [passes.FuseNormModulate()]
            return compile_dit(model, passes=chosen, example_inputs=ex, torch_compile=torch_compile)
        return build

    return {"eager": lambda: model, "graph": make(None), "dbcache_never": make("never"),
            "dbcache_always": make("always"), "compiled_graph": make(None, compile_kwargs),
            "compiled_never": make("never", compile_kwargs), "compiled_always": make("always", compile_kwargs),
            "compiled_regional_never": make("never", regional), "compiled_regional_always": make("always", regional),
            "compiled_regional_fp8_always": make("always", regional, fp8=True),
            "graphed_regional_always": make("always", graphed),
            "graphed_regional_epilogue_always": make("always", graphed, epilogue=True),
            "graphed_regional_fp8_always": make("always", graphed, fp8=True),
            "graphed_regional_epilogue_rope_always": make("always", graphed, epilogue=True, rope=True),
            "graphed_regional_fp8_rope_always": make("always", graphed, fp8=True, rope=True),
            "graphed_regional_epilogue_pointwise_always": make("always", graphed, epilogue=True, rope=True,
                                                               modulate=True),
            "graphed_regional_fp8_pointwise_always": make("always", graphed, fp8=True, rope=True, modulate=True)}


def measure_row(name: str, make: Callable[[], Any], inputs, repeats: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    module = make()
    build_s = time.perf_counter() - t0  # capture + passes (host), 0 for eager
    first = generation(module, inputs)   # includes torch.compile's compile for compiled rows
    runs = [generation(module, inputs) for _ in range(repeats)]
    row = {"build_s": build_s, "first_generation_s": first, "generation_s": statistics.median(runs),
           "runs_s": runs, "step_ms": 1000 * statistics.median(runs) / STEPS}
    summary = getattr(module, "cache_summary", None)
    if callable(summary) and "dbcache" in getattr(module, "runtime").reports:
        row["cached_steps"] = len(module.cache_summary(as_dict=True)[-1]["cached_steps"])
    return row


def derived(results: Dict[str, Any]) -> Dict[str, Any]:
    rows, out = results["rows"], {}
    for pre in ("", "compiled_"):
        base, never = rows.get(f"{pre}graph" if pre else "graph"), rows.get(f"{pre}never" if pre else "dbcache_never")
        if base and never and "error" not in base and "error" not in never:
            out[f"{pre or 'eager_'}cache_overhead_on_compute_steps"] = never["generation_s"] / base["generation_s"] - 1
    return out


def run(size: str, rows: List[str], out: str, repeats: int, compile_kwargs: Dict[str, Any],
        attention: Optional[str] = None) -> Dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if size == "full" and device.type != "cuda":
        raise SystemExit("--size full needs a CUDA GPU (about 30 GiB); use --size tiny on a CPU")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; available: {', '.join(ROWS)}")
    results: Dict[str, Any] = {
        "size": size, "config": SIZES[size][0], "image_tokens": SIZES[size][1], "text_tokens": SIZES[size][2],
        "steps": STEPS, "schedules": schedules(), "compile_kwargs": compile_kwargs, "attention": attention,
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "command": " ".join(sys.argv), "rows": {}}
    t0 = time.perf_counter()
    model = build_model(size, device, dtype)
    results["build_model_s"] = time.perf_counter() - t0
    inputs = make_inputs(size, device, dtype)
    factories = row_factories(model, inputs, compile_kwargs, attention)
    for name in rows:
        try:
            results["rows"][name] = measure_row(name, factories[name], inputs, repeats)
        except Exception as e:  # noqa: BLE001 - record and go on with the other rows
            results["rows"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(name, json.dumps(results["rows"][name]), flush=True)
        if device.type == "cuda":
            results["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        results["derived"] = derived(results)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"bench_flux_{size}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return results


def table(results: Dict[str, Any]) -> str:
    lines = ["| row | capture + passes s | first generation s | 28 steps s | per step ms | cached steps |",
             "|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} | | | | |")
            continue
        lines.append(f"| {name} | {r['build_s']:.2f} | {r['first_generation_s']:.2f} | {r['generation_s']:.3f} | "
                     f"{r['step_ms']:.1f} | {r.get('cached_steps', '-')} |")
    for k, v in results.get("derived", {}).items():
        lines.append(f"\n{k}: {100 * v:+.2f}%")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="dit-passes bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--rows", default="eager,graph,dbcache_never,dbcache_always",
                   help=f"comma-separated rows (default: the eager ones); all: {','.join(ROWS)}")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help=f"named rows (overrides --rows): "
                   f"{'; '.join(f'{k}: {v}' for k, v in PRESETS.items())}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for the compiled_* rows")
    p.add_argument("--attention", default=None, choices=("cudnn", "flash", "efficient", "math"),
                   help="pin the attention kernel (passes.AttentionBackend) in the captured rows")
    p.add_argument("--out", default="out/bench")
    args = p.parse_args(argv)
    compile_kwargs = {} if args.compile_mode is None else {"mode": args.compile_mode}
    rows = PRESETS[args.preset] if args.preset else args.rows
    results = run(args.size, [r.strip() for r in rows.split(",") if r.strip()], args.out, args.repeats,
                  compile_kwargs, args.attention)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
