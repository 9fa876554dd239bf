"""cProfile of the fastest preset's build: ``compile_dit`` of the full FLUX.1-dev transformer with DBCache (F8B0) and the
epilogue passes, where the host time of a first generation goes before Inductor starts.

    .venv/bin/python -P bench/profile_build.py [--out out/profile_build] [--no-stack-traces]    # CPU, meta device
    python3 bench/profile_build.py --device cuda --out $OUT/profile_build                   # GPU: random bf16 weights

On the meta device (no weights, no compute) it builds the model as ``capture_flux_full.py`` does and compiles with
``torch_compile={"regional": True}``; on CUDA it builds the model with random weights as ``dit-passes bench --size
full`` does and compiles with ``{"regional": True, "mode": "reduce-overhead"}`` (the ``graphed_regional_epilogue_
always`` row; the build only: no generation, so nothing is compiled by Inductor). Writes ``build.prof`` (pstats),
``build.txt`` (the phases, then the 60 costliest functions by cumulative and by own time) and prints the phases.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.fx


def _model_and_inputs(device: str):
    if device == "meta":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from capture_flux_full import build_meta
        return (*build_meta(), {"regional": True})
    from dit_passes import bench as B
    dev = torch.device(device)
    model = B.build_model("full", dev, torch.bfloat16)
    return model, B.make_inputs("full", dev, torch.bfloat16), {"regional": True, "mode": "reduce-overhead"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="meta", help="meta (CPU, no weights) or cuda")
    ap.add_argument("--out", default="out/profile_build")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-stack-traces", action="store_true",
                    help="an experiment, not the library's behaviour: torch.fx.config.do_not_emit_stack_traces, so "
                         "export records no node's stack trace (~1.4 s of the 9.3 s capture on the CPU; nodes then "
                         "lack meta['stack_trace'], which error messages and Inductor's provenance comments read)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.no_stack_traces:
        torch.fx.config.do_not_emit_stack_traces = True
    from dit_passes import bench as B
    from dit_passes import compile_dit, passes

    model, inputs, torch_compile = _model_and_inputs(args.device)
    prof = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    compiled = compile_dit(model, passes=[passes.DBCache(**B.schedules()["always"]), passes.SplitConcatLinear(),
                                          passes.FuseLinearGelu()], example_inputs=inputs, torch_compile=torch_compile)
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lowered = compiled._current()
    lines = [f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s)"
             + (", no stack traces" if args.no_stack_traces else ""),
             f"compile_dit under cProfile: {wall:.2f} s wall, {cpu:.2f} s CPU (the profiler adds ~2x to Python code)",
             f"  capture (torch.export + module + flattening): {lowered.captured.seconds:.2f} s"]
    lines += [f"  pass {r.name}: {r.seconds:.3f} s" for r in lowered.manager.records]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    prof.dump_stats(os.path.join(args.out, "build.prof"))
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        text.write(f"\n== by {key}\n")
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
    with open(os.path.join(args.out, "build.txt"), "w") as f:
        f.write("\n".join(lines) + "\n" + text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
