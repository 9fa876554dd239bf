"""DBCache / DBPrune with each calibrator, ours beside cache-dit 1.5.3, on configs beyond the test suite's own.

    python -P bench/calibrator_parity.py                       # the grid, table to stdout
    python -P bench/calibrator_parity.py --out bench/results   # also writes calibrator_parity.md

A tiny FluxPipeline (the tests' transformer: 3 double + 3 single blocks, or the zoo's: 2 + 2; 16x16 latents, fp32
CPU) runs ``steps`` denoising steps twice from the same weights: cache-dit's ``enable_cache`` on a deep copy,
``dit_passes.enable_cache`` on the original, each with the same cache config and calibrator; the zoo's QwenImage
transformer (no tiny pipeline of its family) runs the same way in a plain step loop. A row reports the maximum
relative difference of the final latents (QwenImage: of every step's output) (``max|ours - ref| / max|ref|``), the two cached-step lists' lengths and whether they are equal, and cache-dit's own
cached-vs-uncached difference for scale. A row fails when the difference exceeds 1e-4 or the cached steps differ.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import logging
import pathlib
import sys
import time
from typing import Dict, List

import torch

TOL = 1e-4
TRANSFORMER_FAMILIES = {"qwenimage": dict(num_layers=4)}  # zoo families run without a pipeline, their overrides
TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16  # the tests' tiny Flux


def tiny_flux(model: str = "tests", seed: int = 0):
    """The tests' tiny Flux (3 + 3 blocks, ``tests/test_frontend.py``) or the zoo's (``build("flux")``: 2 + 2)."""
    from diffusers import FluxTransformer2DModel
    if model == "zoo":
        from dit_passes.models.zoo import build
        return build("flux", seed=seed).model
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=3, num_single_layers=3,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def generate(pipe, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = pipe.transformer.config
    kw = dict(prompt_embeds=torch.randn(1, 7, c.joint_attention_dim, generator=g),
              pooled_prompt_embeds=torch.randn(1, c.pooled_projection_dim, generator=g))
    with torch.inference_mode():
        return pipe(height=16, width=16, num_inference_steps=steps, guidance_scale=3.5, output_type="latent",
                    generator=torch.Generator().manual_seed(3), **kw).images


def step_loop(model, inputs: dict, steps: int) -> torch.Tensor:
    """A plain Euler-like loop over the transformer alone (what the tests use for families without a tiny pipeline):
    the timestep falls, the latents move with the output; the stacked outputs."""
    outs, lat = [], inputs["hidden_states"].clone()
    for i in range(steps):
        kw = dict(inputs, hidden_states=lat, timestep=torch.full_like(inputs["timestep"], 1000.0 * (1 - i / steps)))
        with torch.inference_mode():
            o = model(**kw)[0]
        outs.append(o)
        lat = lat - 0.05 * o.reshape(lat.shape)
    return torch.stack(outs)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def calibrators(module) -> Dict[str, object]:
    """name -> a calibrator config of ``module`` (cache_dit or dit_passes: the same field names)."""
    return {"none": None,
            "taylorseer1": module.TaylorSeerCalibratorConfig(taylorseer_order=1),
            "taylorseer2": module.TaylorSeerCalibratorConfig(taylorseer_order=2),
            "foca": module.FoCaCalibratorConfig(),
            "dmd": module.DMDCalibratorConfig()}


def compare(kind: str, cache_kw: dict, calibrator: str, steps: int, uncached: torch.Tensor = None,
            model: str = "tests") -> dict:
    """One row: cache-dit and ours with ``kind`` in {"DBCache", "DBPrune"} and ``cache_kw``."""
    import cache_dit

    import dit_passes
    from dit_passes.testing.pipelines import flux_pipeline
    if model in TRANSFORMER_FAMILIES:  # the transformer alone in a step loop (no tiny pipeline of that family)
        from dit_passes.models.zoo import build
        zm = build(model, **TRANSFORMER_FAMILIES[model])
        inputs = zm.make_inputs()
        cfg = dict(cache_kw, num_inference_steps=steps, enable_separate_cfg=False)
        ref_mod = copy.deepcopy(zm.model)
        cache_dit.enable_cache(ref_mod, cache_config=getattr(cache_dit, kind + "Config")(**cfg),
                               calibrator_config=calibrators(cache_dit)[calibrator])
        ref = step_loop(ref_mod, inputs, steps)
        ref_st = cache_dit.summary(ref_mod, logging=False)[0]
        holder = dit_passes.enable_cache(zm.model, cache_config=getattr(dit_passes, kind + "Config")(**cfg),
                                         calibrator_config=calibrators(dit_passes)[calibrator])
        ours = step_loop(holder, inputs, steps)
    else:
        tr = tiny_flux(model)
        ref_pipe = flux_pipeline(copy.deepcopy(tr))
        cache_dit.enable_cache(ref_pipe, cache_config=getattr(cache_dit, kind + "Config")(**cache_kw),
                               calibrator_config=calibrators(cache_dit)[calibrator])
        ref = generate(ref_pipe, steps)
        # read now: cache-dit 1.5.3 reports no cached steps for this pipeline once any other FluxPipeline has run
        ref_st = cache_dit.summary(ref_pipe, logging=False)[0]
        holder = flux_pipeline(tr)
        dit_passes.enable_cache(holder, cache_config=getattr(dit_passes, kind + "Config")(**cache_kw),
                                calibrator_config=calibrators(dit_passes)[calibrator])
        ours = generate(holder, steps)
    ref_steps = list(ref_st.cached_steps or [])
    if kind == "DBPrune":
        ref_steps = sorted(set(ref_steps) | set(ref_st.pruned_steps or []))
    st = dit_passes.summary(holder, logging=False)[0]
    our_steps = list(st.cached_steps or [])
    if kind == "DBPrune":
        our_steps = sorted(set(our_steps) | set(getattr(st, "pruned_steps", None) or []))
    row = dict(model=model, kind=kind, calibrator=calibrator, **cache_kw, rel=rel(ours, ref), ref_cached=len(ref_steps),
               our_cached=len(our_steps), same_steps=ref_steps == our_steps,
               ref_vs_uncached=None if uncached is None else rel(ref, uncached))
    row["ok"] = row["rel"] <= TOL and row["same_steps"]
    return row


def grid(quick: bool, models: List[str]) -> List[tuple]:
    """(model, kind, cache kwargs, calibrator): warm-up 2-4, Fn 1-2, Bn 0-1, thresholds 0.1-0.6; the runs of cached
    steps capped in two (uneven spacings of the computed steps: DMD's Taylor fallback, FoCa's damped step)."""
    def shape(fn, bn, thr, warm, **more):
        return dict(Fn_compute_blocks=fn, Bn_compute_blocks=bn, residual_diff_threshold=thr, max_warmup_steps=warm,
                    **more)
    shapes = [shape(2, 0, 0.4, 3),  # the shape of a reported DMD mismatch
              shape(1, 1, 0.6, 2), shape(2, 1, 0.25, 4), shape(1, 0, 0.1, 3), shape(2, 0, 0.3, 2),
              shape(1, 0, 0.5, 4, max_continuous_cached_steps=2), shape(2, 1, 0.6, 3, max_continuous_cached_steps=3)]
    if quick:
        shapes = shapes[:1]
    cals = ["taylorseer1", "taylorseer2", "foca", "dmd"]
    return list(itertools.product(models, ["DBCache", "DBPrune"], shapes, cals))


def table(rows: List[dict], steps: int) -> str:
    head = ("| model | cache | calibrator | Fn | Bn | threshold | warm-up | max rel diff | cached (cache-dit) | "
            "cached (ours) | same steps | max continuous | cache-dit vs uncached | ok |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        unc = "" if r["ref_vs_uncached"] is None else f"{r['ref_vs_uncached']:.1e}"
        lines.append(f"| {r['model']} | {r['kind']} | {r['calibrator']} | {r['Fn_compute_blocks']} | {r['Bn_compute_blocks']} | "
                     f"{r['residual_diff_threshold']} | {r['max_warmup_steps']} | {r['rel']:.2e} | {r['ref_cached']} | "
                     f"{r['our_cached']} | {r['same_steps']} | {r.get('max_continuous_cached_steps', -1)} | {unc} | {'yes' if r['ok'] else 'NO'} |")
    bad = sum(not r["ok"] for r in rows)
    worst = max(r["rel"] for r in rows)
    idle = sum(r["ref_cached"] == 0 for r in rows)
    lines += ["", f"{len(rows)} configs, {steps} steps each: {len(rows) - bad} within {TOL:g} with the same cached "
              f"steps, {bad} not; the largest difference {worst:.2e}. {idle} configs cache no step in cache-dit either "
              f"(their threshold is below this model's residual diffs): there the two runs compare uncached."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="the issue's shape only (Fn=2, Bn=0, 0.4, warm-up 3)")
    ap.add_argument("--models", default="tests,zoo,qwenimage",
                    help="tiny Flux pipelines: tests (3 + 3 blocks), zoo (2 + 2); qwenimage: the zoo's (4 blocks), "
                         "the transformer alone in a step loop")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="folder for calibrator_parity.md")
    args = ap.parse_args(argv)
    logging.getLogger("cache_dit").setLevel(logging.ERROR)
    logging.getLogger("dit_passes").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    from dit_passes.testing.pipelines import flux_pipeline
    models = args.models.split(",")
    from dit_passes.models.zoo import build
    uncached = {m: step_loop(build(m, **TRANSFORMER_FAMILIES[m]).model, build(m, **TRANSFORMER_FAMILIES[m]).make_inputs(),
                             args.steps) if m in TRANSFORMER_FAMILIES else generate(flux_pipeline(tiny_flux(m)), args.steps)
                for m in models}
    rows, t0 = [], time.time()
    for model, kind, kw, cal in grid(args.quick, models):
        r = compare(kind, kw, cal, args.steps, uncached[model], model)
        rows.append(r)
        print(f"{model} {kind} {cal} {kw}: rel {r['rel']:.2e} cached {r['ref_cached']}/{r['our_cached']} "
              f"same {r['same_steps']}", flush=True)
    text = table(rows, args.steps)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = "python -P bench/calibrator_parity.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = (f"# Calibrator parity: ours vs cache-dit 1.5.3\n\nWritten by `{cmd.strip()}` "
               f"(models {args.models}: see the script's docstring; fp32 CPU, torch {torch.__version__}; "
               f"{time.time() - t0:.0f} s).\n"
               f"Difference: max|ours - cache-dit| / max|cache-dit| of the final latents (qwenimage: of the step "
               f"loop's outputs); a row is ok within "
               f"{TOL:g} and with the same cached (DBPrune: cached or pruned) steps.\n\n{text}\n")
        (args.out / "calibrator_parity.md").write_text(doc)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
