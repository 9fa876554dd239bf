"""Timing of one callable on the GPU (or the CPU), for the bench scripts beside it: the median of single calls
(:func:`median_ms`), of calls back to back (:func:`back_to_back_ms`) and of calls replayed from one CUDA graph
(:func:`graphed_ms`, captured by :func:`capture`)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], Any], repeats: int, device: torch.device, batch: int):
    """Median ms per call over ``batch`` calls enqueued back to back between two events: the GPU time with the CPU
    running ahead (its per-call Python and launch overhead hidden, as in a step whose CPU runs ahead of the GPU);
    None off the GPU or for ``batch`` 0."""
    if device.type != "cuda" or batch <= 0:
        return None
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, repeats // 2)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def capture(fn: Callable[[], Any], batch: int, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``batch`` calls of ``fn`` captured in one CUDA graph, after ``warmup`` calls on a side stream (warm-up off
    the default stream, as torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(batch):
            fn()
    return graph


def graphed_ms(fn: Callable[[], Any], repeats: int, device: torch.device, batch: int):
    """Median ms per call with ``batch`` calls captured in one CUDA graph and replayed: the linear as the graphed
    step runs it (no host time, the gaps between its kernels kept); None off the GPU, for ``batch`` 0, or where the
    design cannot be captured (the error is printed)."""
    if device.type != "cuda" or batch <= 0:
        return None
    try:
        graph = capture(fn, batch)
    except Exception as e:  # noqa: BLE001 - a design that cannot be captured still gets its other times
        print(f"graphed_ms: not captured: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, repeats // 2)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / batch)
    del graph
    return statistics.median(times)
