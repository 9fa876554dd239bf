"""Host time to capture the full FLUX.1-dev-size transformer (meta device: no weights, no compute).

    .venv/bin/python -P bench/capture_flux_full.py [--out bench/results]

Builds FluxTransformer2DModel with the FLUX.1-dev config on ``torch.device("meta")`` in bf16, with the
inputs of a 1024x1024 generation (4096 image tokens, 512 text tokens), and times
``compile_dit(model, passes=[], example_inputs=...)``: torch.export capture + cleanup + block
discovery; then the same with ``passes=[DBCache(F8B0), SplitConcatLinear(), FuseLinearGelu()]`` and
``torch_compile={"regional": True}`` (the fastest preset's bf16 build: the host part of a first generation). Asserts
the structure (19 double + 38 single blocks, 57 attention sites) and writes ``capture_flux_full.json`` and ``.md``
(wall and this process's CPU seconds; what it measures only: earlier runs' figures stay in their results files).
Target: < 20 s. Where the time goes: ``bench/profile_build.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
IMAGE_TOKENS, TEXT_TOKENS = 4096, 512   # 1024x1024: (1024/8/2)^2 packed latent tokens; T5 max length
TARGET_S = 20.0
COMMAND = ".venv/bin/python -P bench/capture_flux_full.py"


def build_meta(dtype=torch.bfloat16):
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as dlogging

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # .to(dtype) warns about keep-in-fp32 modules (Flux has none)
    try:
        with torch.device("meta"):
            model = FluxTransformer2DModel(**FLUX_DEV).to(dtype).eval()
    finally:
        dlogging.set_verbosity(verbosity)
    with torch.device("meta"):
        inputs = dict(
            hidden_states=torch.empty(1, IMAGE_TOKENS, FLUX_DEV["in_channels"], dtype=dtype),
            encoder_hidden_states=torch.empty(1, TEXT_TOKENS, FLUX_DEV["joint_attention_dim"], dtype=dtype),
            pooled_projections=torch.empty(1, FLUX_DEV["pooled_projection_dim"], dtype=dtype),
            timestep=torch.empty(1, dtype=dtype), img_ids=torch.empty(IMAGE_TOKENS, 3, dtype=dtype),
            txt_ids=torch.empty(TEXT_TOKENS, 3, dtype=dtype), guidance=torch.empty(1, dtype=dtype),
            return_dict=False)
    return model, inputs


def run() -> dict:
    from dit_passes import compile_dit

    t0 = time.perf_counter()
    model, inputs = build_meta()
    t_build = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())

    t0, c0 = time.perf_counter(), time.process_time()
    compiled = compile_dit(model, passes=[], example_inputs=inputs)
    t_compile, c_compile = time.perf_counter() - t0, time.process_time() - c0
    lowered = compiled._current()
    t0 = time.perf_counter()
    s = compiled.structure  # discovery on the cleaned graph (cleanup invalidated the first one)
    t_discover = time.perf_counter() - t0

    # the fastest preset's build: capture + DBCache (F8B0) + the epilogue passes + regional compile's setup, the host part of
    # a first generation of `dit-passes bench --preset fastest`'s bf16 row
    from dit_passes import bench as B
    from dit_passes import passes
    t0, c0 = time.perf_counter(), time.process_time()
    cached = compile_dit(model, passes=[passes.DBCache(**B.schedules()["always"]), passes.SplitConcatLinear(),
                                        passes.FuseLinearGelu()], example_inputs=inputs,
                         torch_compile={"regional": True})
    t_dbcache, c_dbcache = time.perf_counter() - t0, time.process_time() - c0
    per_pass = {r.name: round(r.seconds, 3) for r in cached._current().manager.records}
    del cached

    lists = [(bl.name, bl.count) for bl in s.block_lists]
    assert lists == [("transformer_blocks", 19), ("single_transformer_blocks", 38)], lists
    assert len(s.blocks) == 57 and s.num_streams == 2
    assert len(s.attention) == 57 and sorted({a.block for a in s.attention}) == list(range(57))
    assert {(a.num_heads, a.head_dim, a.q_len) for a in s.attention} == {(24, 128, IMAGE_TOKENS + TEXT_TOKENS)}
    nodes = len(lowered.gm.graph.nodes)
    return {
        "benchmark": "capture_flux_full",
        "command": COMMAND,
        "model": "FluxTransformer2DModel (FLUX.1-dev config), meta device, bf16",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in FLUX_DEV.items()},
        "parameters": params,
        "image_tokens": IMAGE_TOKENS, "text_tokens": TEXT_TOKENS,
        "seconds": {"build_model": round(t_build, 3), "compile_dit_total": round(t_compile, 3),
                    "capture_export": round(lowered.captured.seconds, 3),
                    "cleanup_and_discovery": round(t_compile - lowered.captured.seconds, 3),
                    "rediscovery_after_cleanup": round(t_discover, 3),
                    "dbcache_regional_total": round(t_dbcache, 3), "dbcache_regional_passes": per_pass},
        # this process's CPU time: on a shared machine, what other jobs' load changes least
        "cpu_seconds": {"compile_dit_total": round(c_compile, 3), "dbcache_regional_total": round(c_dbcache, 3)},
        "target_seconds": TARGET_S, "meets_target": t_compile < TARGET_S,
        "structure": {"block_lists": lists, "blocks": len(s.blocks), "streams": s.num_streams,
                      "attention_sites": len(s.attention), "linears": len(s.linears), "graph_nodes": nodes},
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "cpu_threads": torch.get_num_threads(), "machine": platform.machine(),
                 "cpu_count": os.cpu_count(), "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()]},
    }


def write(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "capture_flux_full.json"), "w") as f:
        json.dump(result, f, indent=2)
    sec, st, cpu = result["seconds"], result["structure"], result["cpu_seconds"]
    md = [
        "# Capture of the full FLUX.1-dev transformer (meta device)", "",
        f"Command: `{result['command']}`", "",
        f"{result['model']}, {result['parameters'] / 1e9:.2f} B parameters; inputs of a 1024x1024 image "
        f"({result['image_tokens']} image + {result['text_tokens']} text tokens).", "",
        "| step | seconds |", "|---|---|",
        f"| `compile_dit(model, passes=[], example_inputs=...)` total | **{sec['compile_dit_total']}** "
        f"(CPU {cpu['compile_dit_total']}) |",
        f"| of which torch.export capture | {sec['capture_export']} |",
        f"| of which cleanup + block discovery | {sec['cleanup_and_discovery']} |",
        f"| re-discovery after cleanup (`compiled.structure`) | {sec['rediscovery_after_cleanup']} |",
        f"| building the meta model | {sec['build_model']} |",
        "| `compile_dit(model, passes=[DBCache(F8B0), SplitConcatLinear(), FuseLinearGelu()], "
        "torch_compile={'regional': True})` total (the fastest preset's build) "
        f"| **{sec['dbcache_regional_total']}** (CPU {cpu['dbcache_regional_total']}) |",
        *[f"| of which pass `{k}` | {v} |" for k, v in sec["dbcache_regional_passes"].items()], "",
        f"Target < {result['target_seconds']:.0f} s: {'met' if result['meets_target'] else 'NOT met'}.", "",
        "Where the time goes: `bench/profile_build.py` (cProfile of the same build).", "",
        f"Structure found: {st['block_lists']}, {st['blocks']} blocks, {st['streams']} streams, "
        f"{st['attention_sites']} attention sites, {st['linears']} linears, {st['graph_nodes']} graph nodes.", "",
        f"Host: torch {result['host']['torch']}, Python {result['host']['python']}, "
        f"{result['host']['cpu_threads']} torch thread(s) of {result['host']['cpu_count']} CPUs "
        f"(a shared machine: other jobs were running; load average {result['host']['load_average_1_5_15min']} at "
        "the end of the run).", "",
    ]
    with open(os.path.join(out_dir, "capture_flux_full.md"), "w") as f:
        f.write("\n".join(md))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run()
    write(result, args.out)
    print(json.dumps(result["seconds"]), "structure:", result["structure"])
    return 0 if result["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
