"""The FLUX.1-dev-size cache table's peers, measured in the same run as our rows: cache-dit, diffusers'
FirstBlockCache, and our layerwise offload (with DBCache) against no offload.

Run on a CUDA machine with dit_passes importable (installed: ``pip install --no-deps .``, as ``bench/device_env.sh`` does) and
diffusers and cache-dit too (e.g. as wheels carried by ``../shared/tools/device-wheels cache-dit==1.5.3``)::

    python bench/flux_peers.py --rows cachedit_never,cachedit_always,fbcache_never,fbcache_always,dbcache_always,offload_always --out $OUT

It uses ``dit_passes.bench``'s model (random bf16 weights, 1024² = 4096 image + 512 text tokens), inputs, toy
28-step loop and forced schedules (never: threshold 0; always: cache every step after 8 warm-up steps, F8B0).
Rows:

* ``torchcompile_never``: ``torch.compile(model)`` (default mode), no cache: the first generation includes
  the compile;
* ``cachedit_*``: cache-dit's ``enable_cache`` with ``DBCacheConfig`` of the same fields, eager;
* ``cacheditregional_*`` / ``cacheditcompile_*``: the same, compiled: ``compile_repeated_blocks()`` (the path
  cache-dit's own Ray workers take) / ``torch.compile`` of the whole transformer after
  ``cache_dit.set_compile_configs()``; the first generation includes the compile;
* ``fbcache_*``: diffusers' ``FirstBlockCacheConfig`` (``model.enable_cache``), eager, inside one
  ``cache_context`` per generation. It has no warm-up field: *never* is threshold 0, *always* a threshold
  no diff reaches, so it caches from the second step on (27 of 28, not our 20): a different schedule, listed
  for its per-step cost;
* ``dbcache_always``: ours, eager, for the same run's comparison;
* ``offload_always``: ``LayerwiseOffload(async_transfer=True)`` + the same DBCache: the block weights stay in
  pinned host memory and each block is loaded as it runs; a cached step loads only the Fn blocks.

Each system gets a freshly built model (cache-dit's ``disable_cache`` leaves its patched forward in place, and
the offload row moves the block weights to the host).

Each row: the first generation and the median of ``--repeats`` more (host clock after a device sync), the
number of cached steps where the system reports it, and the peak GPU memory of the row. JSON written after
each row to ``--out/flux_peers.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch

from dit_passes import bench as B

ROWS = ("torchcompile_never", "cachedit_never", "cachedit_always", "fbcache_never", "fbcache_always", "dbcache_always",
        "offload_always", "cacheditregional_always", "cacheditcompile_always")


def _cachedit(model, schedule: str) -> Tuple[Any, Callable[[], None], Callable[[], None]]:
    import cache_dit
    from cache_dit import DBCacheConfig
    s = B.schedules()[schedule]
    cache_dit.enable_cache(model, cache_config=DBCacheConfig(
        Fn_compute_blocks=s["Fn_compute_blocks"], Bn_compute_blocks=0, max_warmup_steps=s["max_warmup_steps"],
        residual_diff_threshold=s["residual_diff_threshold"], num_inference_steps=B.STEPS))
    return model, (lambda: None), (lambda: cache_dit.disable_cache(model))


def _cachedit_compiled(model, schedule: str, regional: bool) -> Tuple[Any, Callable[[], None], Callable[[], None]]:
    """cache-dit's DBCache, then compiled as cache-dit does it: ``regional`` is the path its Ray workers take
    (``compile_repeated_blocks()`` where the transformer has it); otherwise the whole transformer under
    ``torch.compile`` after ``cache_dit.set_compile_configs()`` (its recommended settings), default mode."""
    import cache_dit
    module, reset, undo = _cachedit(model, schedule)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if regional:
        model.compile_repeated_blocks()
        return model, reset, undo
    cache_dit.set_compile_configs()
    return torch.compile(model), reset, undo


def _fbcache(model, schedule: str) -> Tuple[Any, Callable[[], None], Callable[[], None]]:
    from diffusers.hooks import FirstBlockCacheConfig
    threshold = 0.0 if schedule == "never" else 1e9

    def reset() -> None:  # a fresh cache state for each generation
        model.disable_cache()
        model.enable_cache(FirstBlockCacheConfig(threshold=threshold))

    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    return model, reset, model.disable_cache


def _ours(model, inputs, offload: bool) -> Tuple[Any, Callable[[], None], Callable[[], None]]:
    from dit_passes import compile_dit, passes
    pipeline = [passes.DBCache(**B.schedules()["always"])]
    if offload:
        device = inputs["hidden_states"].device
        pipeline.insert(0, passes.LayerwiseOffload(onload_device=device, offload_device="cpu", async_transfer=True))
    compiled = compile_dit(model, passes=pipeline, example_inputs=dict(inputs))
    return compiled, (lambda: None), (lambda: None)


def _generation(module, inputs, context: bool) -> float:
    ctx = module.cache_context("bench") if context else contextlib.nullcontext()
    with ctx:
        return B.generation(module, inputs)


def measure(name: str, model, inputs, repeats: int) -> Dict[str, Any]:
    system, schedule = name.split("_", 1)
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    if system == "cachedit":
        module, reset, undo = _cachedit(model, schedule)
    elif system in ("cacheditregional", "cacheditcompile"):
        module, reset, undo = _cachedit_compiled(model, schedule, regional=system == "cacheditregional")
    elif system == "fbcache":
        module, reset, undo = _fbcache(model, schedule)
    elif system == "torchcompile":  # the plain model under torch.compile (default mode), no cache
        module, reset, undo = torch.compile(model), (lambda: None), (lambda: None)
    else:
        module, reset, undo = _ours(model, inputs, offload=system == "offload")
    build_s = time.perf_counter() - t0
    if cuda:  # the peak of the generations: after the offload row moved its block weights to the host
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    context = system == "fbcache"
    try:
        first = _generation(module, inputs, context)
        runs = []
        for _ in range(repeats):
            reset()
            runs.append(_generation(module, inputs, context))
        row: Dict[str, Any] = {"build_s": build_s, "first_generation_s": first, "generation_s": statistics.median(runs),
                               "runs_s": runs, "step_ms": 1000 * statistics.median(runs) / B.STEPS,
                               "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0}
        if hasattr(module, "runtime") and "dbcache" in module.runtime.state:
            row["cached_steps"] = len(module.cache_summary(as_dict=True)[-1]["cached_steps"])
        if system.startswith("cachedit"):
            import cache_dit
            stats = cache_dit.summary(model)
            row["cached_steps"] = len(stats[0].cached_steps) if stats and stats[0].cached_steps is not None else None
        return row
    finally:
        undo()


def table(res: Dict[str, Any]) -> str:
    lines = ["| row | first generation s | 28 steps s | per step ms | cached steps | peak GiB |", "|---|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:150]} | | | | |")
        else:
            lines.append(f"| {name} | {r['first_generation_s']:.2f} | {r['generation_s']:.3f} | {r['step_ms']:.1f} | "
                         f"{r.get('cached_steps', '-')} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--size", choices=tuple(B.SIZES), default="full", help="tiny: a CPU smoke run of the script")
    p.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad or (args.size == "full" and not torch.cuda.is_available()):
        raise SystemExit(f"unknown rows {bad} (available: {', '.join(ROWS)})" if bad else "--size full needs a CUDA GPU")
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    inputs = B.make_inputs(args.size, device, dtype)
    model, model_of = None, None
    res: Dict[str, Any] = {"command": "python bench/flux_peers.py " + " ".join(argv or sys.argv[1:]),
                           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "size": args.size, "torch": torch.__version__,
                           "schedules": B.schedules(), "rows": {}}
    for name in rows:
        system = name.split("_")[0]
        if system != model_of:  # a fresh model per system: cache-dit's disable_cache keeps its patched forward,
            del model           # and the offload row moves the block weights to the host
            if cuda:
                torch.cuda.empty_cache()
            model, model_of = B.build_model(args.size, device, dtype), system
        try:
            res["rows"][name] = measure(name, model, inputs, args.repeats)
        except Exception as e:  # noqa: BLE001 - record and go on
            res["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps({k: v for k, v in res["rows"][name].items() if k != "trace"}), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flux_peers.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
