"""Self-test of our ctypes CUDA-graph IF nodes (dit_passes/infra/cuda_if_node.py) on a GPU, one stage at a time.

Run by bench/cuda_if_node.sh (``DIT_PASSES_CUDA_TRACE=1``: every CUDA / NVRTC call with its return code goes to
stderr). Every stage prints PASS or FAIL with its traceback and the next stage still runs; the exit code is the
number of failed stages. Writes ``$OUT/if_node_selftest.json``.

Stages: environment and libraries; kernel compile + load; a toy ``torch.cond`` (nested cond, integer predicate)
captured with IF nodes and replayed with the predicates flipped on the device under
``torch.cuda.set_sync_debug_mode("error")``; the same through ``CudaGraphStep`` with a matmul in each arm (cuBLAS on
the side stream, allocations in the graph pool) plus a profiler check that replays copy nothing device-to-host;
replay timing.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from dit_passes.infra import cuda_if_node as m
from dit_passes.infra.cuda_graph_step import (BothArms, CudaGraphStep, IfNodeCapture, conditional_capture_mode,
                                              torch_has_if_nodes)

RESULTS: dict = {}
COND = torch.ops.higher_order.cond


def stage(name):
    def wrap(fn):
        print(f"===== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            info = fn()
            RESULTS[name] = {"ok": True, "s": round(time.perf_counter() - t0, 3), **(info or {})}
            print(f"PASS {name} {info or ''}", flush=True)
        except BaseException as e:  # noqa: BLE001 - report every failure and go on to the next stage
            RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
        return fn
    return wrap


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the environment report lists what it could not read
        return f"{type(e).__name__}: {e}"


@stage("environment")
def _env():
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "torch_has_if_nodes": torch_has_if_nodes(),
            "device": _safe(torch.cuda.get_device_name), "capability": _safe(torch.cuda.get_device_capability),
            "loaded_cudart": m._loaded("libcudart.so"), "loaded_nvrtc": m._loaded("libnvrtc.so"),
            "site_cudart": m._site_libs("libcudart.so*"), "site_nvrtc": m._site_libs("libnvrtc.so*"),
            "pool_calls": [n for n in dir(torch._C) if "AllocateToPool" in n or "AllocateCurrent" in n
                           or n == "_cuda_releasePool"],
            "cudart": _safe(lambda: (m._cudart().path, m._cudart().version, m._cudart().names)),
            "nvrtc": _safe(lambda: m._nvrtc().path), "driver": _safe(lambda: m._driver().path)}
    print(json.dumps(info, indent=1, default=str), flush=True)
    bad = [k for k in ("device", "cudart", "nvrtc", "driver") if isinstance(info[k], str) and ": " in info[k]
           and not info[k].startswith("/")]
    assert not bad, f"cannot read {bad}"
    return info


@stage("kernel")
def _kernel():
    m.prepare()
    return {"mode": conditional_capture_mode().__name__}


def _toy(pred, inner, x):
    def true_arm(a):
        (z,) = COND(inner, lambda b: (b * 2 + 1,), lambda b: (b + 100,), (a,))
        return (z * 1,)

    (y,) = COND(pred, true_arm, lambda a: (a - 3,), (x,))
    return y * 10


def _want(flag, flag2, x):
    return ((x * 2 + 1 if flag2 else x + 100) if flag else x - 3) * 10


@stage("toy cond: IfNodeCapture, replays flip the arms, no sync")
def _toy_stage():
    pred = torch.zeros((), dtype=torch.bool, device="cuda")
    inner = torch.zeros((), dtype=torch.int64, device="cuda")
    x = torch.arange(8.0, device="cuda")
    with BothArms():
        _toy(pred, inner, x)
    torch.cuda.synchronize()
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    mode = IfNodeCapture(pool)
    with torch.cuda.graph(graph, pool=pool), mode:
        out = _toy(pred, inner, x)
    nodes = mode._ours.nodes if mode._ours is not None else "torch's"
    checked = 0
    for flag, flag2 in ((True, 1), (False, 1), (True, 0), (False, 0), (True, -5)):
        pred.fill_(flag)
        inner.fill_(flag2)
        x.add_(1)
        torch.cuda.set_sync_debug_mode("error")
        graph.replay()
        torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(out, _want(flag, flag2, x))
        checked += 1
    return {"replays_checked": checked, "if_nodes": nodes}


def _step_fn(w):
    def fn(pred, x):
        (y,) = COND(pred, lambda a: (torch.relu(a @ w),), lambda a: ((a @ w.t()) * 0.5,), (x,))
        return (y + x, pred.clone())
    return fn


@stage("CudaGraphStep: matmul arms, pool, profiler sees no DtoH copy, timing")
def _step_stage():
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda")
    step = CudaGraphStep(_step_fn(w), pool=torch.cuda.graph_pool_handle())
    x = torch.randn(64, 256, device="cuda")
    eager = _step_fn(w)
    for i, flag in enumerate([True, False, True, True, False, False, True]):
        pred = torch.tensor(flag, device="cuda")
        x = x + 0.01 * i
        if i >= 2:  # call 1 warms up, call 2 captures; then replays only
            torch.cuda.set_sync_debug_mode("error")
        got = step(pred, x)
        torch.cuda.set_sync_debug_mode(0)
        ref = eager(pred, x)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert step.replays == 6, step.replays
    from torch.profiler import ProfilerActivity, profile
    pred_t, pred_f = torch.tensor(True, device="cuda"), torch.tensor(False, device="cuda")  # made before: a sync
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for p in (pred_t, pred_f, pred_t, pred_f):
            step(p, x)
    torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    dtoh = [n for n in names if any(k in n for k in ("DtoH", "Device -> P", "cudaStreamSynchronize",
                                                      "_local_scalar_dense"))]
    assert not dtoh, f"device-to-host traffic in replays: {sorted(set(dtoh))}"
    assert any("GraphLaunch" in n for n in names), f"no cudaGraphLaunch seen: {sorted(set(names))[:40]}"
    times = {}
    for label, p in (("true", pred_t), ("false", pred_f)):
        step(p, x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            step(p, x)
        torch.cuda.synchronize()
        times[f"replay_us_{label}"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return {"profiler_events": len(names), **times}


out_dir = os.environ.get("OUT", ".")
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "if_node_selftest.json"), "w") as f:
    json.dump(RESULTS, f, indent=1, default=str)
failed = [k for k, v in RESULTS.items() if not v["ok"]]
print(f"selftest: {len(RESULTS) - len(failed)} passed, {len(failed)} failed {failed}", flush=True)
sys.exit(len(failed))
