"""RayLauncher start-up cost per transfer path, on CPU: time to a usable engine and per-worker memory.

For each path (object_store, snapshot, factory) the launcher starts its own Ray (so ``ray.init`` is
timed), launches a FluxPipeline whose transformer is the zoo flux scaled up to ~78 MiB of fp32 weights
on 2 gloo workers with ``passes=[]``, runs one 2-step call (checked against the single-process latents),
reads each worker's memory from /proc (peak RSS = VmHWM; RssAnon = private pages, RssShmem = pages
shared with Ray's object store) and shuts down. A "baseline" row (factory path, the tiny zoo model)
gives the footprint of a worker with torch + diffusers imported and almost no weights.

    .venv/bin/python bench/ray_startup.py [--out bench/results/ray_startup]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

MODEL = dict(num_attention_heads=8, attention_head_dim=48, num_layers=2, num_single_layers=4,
             axes_dims_rope=(16, 16, 16))
TEXT_DIM = 32


def make_pipeline(scaled: bool = True):
    """Defined in __main__: cloudpickled by value, so the factory path needs nothing on the workers' path."""
    from dit_passes.models.zoo import build
    from dit_passes.testing.pipelines import flux_pipeline
    return flux_pipeline(build("flux", **(MODEL if scaled else {})).model)


def make_scaled():
    return make_pipeline(True)


def make_tiny():
    return make_pipeline(False)


def call_kwargs() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_prompt_embeds=torch.randn(1, TEXT_DIM, generator=g), height=32, width=32,
                num_inference_steps=2, guidance_scale=3.5, output_type="latent",
                generator=torch.Generator().manual_seed(3))


def measure(name: str, transfer: str, reference: torch.Tensor, scaled: bool) -> dict:
    from dit_passes.launch.ray_launcher import RayLauncher
    source = (make_scaled if scaled else make_tiny) if transfer == "factory" else make_pipeline(scaled)
    t0 = time.perf_counter()
    engine = RayLauncher(world_size=2, num_cpus_per_worker=1, timeout_s=300).launch(source, passes=[],
                                                                                    transfer=transfer)
    launch_s = time.perf_counter() - t0
    try:
        loaded = engine.memory()
        t1 = time.perf_counter()
        latents = engine(**call_kwargs()).images
        call_s = time.perf_counter() - t1
        memory = engine.memory()  # after a call: every weight page has been touched
        max_diff = float((latents - reference).abs().max()) if scaled else None
        report = dict(engine.transfer_report)
    finally:
        engine.shutdown()
    mib = 1 << 20
    return {
        "row": name, "transfer": transfer, "launch_s": round(launch_s, 2),
        **{k: round(v, 3) for k, v in engine.startup.items()},
        "first_call_s": round(call_s, 2), "max_abs_diff_vs_single_process": max_diff,
        "weights_mib": round(report.get("weights_bytes", 0) / mib, 1) if transfer == "object_store" else None,
        "workers": [{k: round(v / mib, 1) for k, v in m.items()} for m in memory],
        "workers_after_launch": [{k: round(v / mib, 1) for k, v in m.items()} for m in loaded],
        "worker_load": [{k: round(v, 3) for k, v in w.items() if k.endswith("_s")} for w in report["workers"]],
    }


def to_markdown(result: dict) -> str:
    lines = [f"# RayLauncher start-up on CPU ({result['weights_mib']} MiB fp32 transformer, 2 gloo workers)", "",
             f"Command: `{result['command']}`  ", f"Host: {result['host']}; torch {result['torch']}, "
             f"ray {result['ray']}", "",
             "| row | transfer | ray.init s | actors ready s | process group s | driver pack s | transfer + passes s"
             " | total s | peak RSS / worker MiB | private (anon) MiB | shared-store MiB | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        w = r["workers"]
        peak = "/".join(f"{x['peak_rss']:.0f}" for x in w)
        anon = "/".join(f"{x.get('rss_anon', 0):.0f}" for x in w)
        shm = "/".join(f"{x.get('rss_shmem', 0):.0f}" for x in w)
        diff = "-" if r["max_abs_diff_vs_single_process"] is None else f"{r['max_abs_diff_vs_single_process']:.1e}"
        lines.append(f"| {r['row']} | {r['transfer']} | {r['ray_init_s']:.2f} | {r['actors_ready_s']:.2f} | "
                     f"{r['process_group_s']:.2f} | {r['driver_pack_s']:.2f} | {r['transfer_and_passes_s']:.2f} | "
                     f"{r['total_s']:.2f} | {peak} | {anon} | {shm} | {diff} |")
    lines += ["", "Memory is read in each worker after the first call (rank 0 / rank 1; the JSON also has it "
              "right after launch, before the weights' pages are touched). *private* = RssAnon, *shared-store* "
              "= RssShmem (pages of Ray's object store mapped by the worker: on the object_store path the weights "
              "are views of the one shared copy, so they show here and not as private memory). Start-up columns "
              "are the engine's `startup` timings; `transfer + passes` includes building the model in the "
              "workers and compile_dit (capture is lazy: at the first call).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/ray_startup", help="output path without extension")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import ray
    if ray.is_initialized():
        raise SystemExit("run without a Ray already initialised: ray.init is part of what is timed")
    with torch.inference_mode():
        reference = make_pipeline(True)(**call_kwargs()).images
    weights = sum(p.numel() * p.element_size() for p in make_pipeline(True).transformer.parameters())
    rows = [measure("baseline (tiny model)", "factory", reference, scaled=False)]
    for transfer in ("object_store", "snapshot", "factory"):
        rows.append(measure("scaled flux", transfer, reference, scaled=True))
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": ".venv/bin/python bench/ray_startup.py " + " ".join(sys.argv[1:]),
              "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
              "ray": ray.__version__, "weights_mib": round(weights / (1 << 20), 1), "model": MODEL, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
