"""Run a function on N CPU processes joined by a torch.distributed process group (tests only).

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` fresh processes (``spawn`` start method:
no state inherited from the driver), initialises a process group in each (gloo by default, on a free
port of 127.0.0.1), calls ``fn(rank, world_size, *args)`` and returns the ranks' return values as a
list in rank order.

Guarantees:

* a rank that raises -> the driver raises :class:`RankFailedError` carrying that rank's traceback,
  and the other ranks (which may be stuck in a collective waiting for it) are killed;
* no result from every rank within ``timeout`` seconds -> :class:`RankTimeoutError` naming the ranks
  that did not finish; all processes are killed;
* a rank that dies without reporting (segfault, ``os._exit``) -> :class:`RankFailedError` with its
  exit code;
* no process is left behind: every worker is joined (killed first if still alive) before
  ``run_ranks`` returns or raises.

Return values travel as ``torch.save`` bytes, not as shared-memory tensors: a worker ends with
``os._exit`` right after reporting, and a shared-memory tensor would need its sender alive while the
driver unpickles it.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing.util
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks"]

# How long the driver blocks on the result queue between liveness checks (seconds).
_POLL_S = 0.05
# Grace period for a worker to exit after it reported, before it is killed (seconds).
_EXIT_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A rank raised (``rank_traceback`` holds its formatted traceback) or died without reporting."""

    def __init__(self, rank: int, message: str, rank_traceback: str | None = None):
        self.rank = rank
        self.rank_traceback = rank_traceback
        super().__init__(message)


class RankTimeoutError(TimeoutError):
    """Not every rank reported within the timeout; ``pending_ranks`` are the ones that did not."""

    def __init__(self, pending_ranks: list[int], timeout: float):
        self.pending_ranks = pending_ranks
        super().__init__(
            f"ranks {pending_ranks} did not finish within {timeout:g} s (a hang, e.g. a collective "
            "that not every rank entered); all worker processes were killed"
        )


def _free_port() -> int:
    # The port is released before rank 0 binds it; another process could take it in between, which
    # then shows up as rank 0 failing to bind (a RankFailedError), never as a silent hang.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(rank, world_size, port, backend, timeout, fn, args, result_queue):
    """Body of one spawned rank: init, run ``fn``, report, tear down, ``os._exit``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            if backend == "nccl":
                # One GPU per rank, chosen before NCCL creates its communicators.
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            result = fn(rank, world_size, *args)
            message = (rank, "ok", _to_bytes(result))
        except BaseException:  # noqa: BLE001 - every failure must reach the driver
            message = (rank, "error", traceback.format_exc())
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - teardown must not hide the result
                    pass
        result_queue.put(message)
        # put() hands the message to a feeder thread; wait until it is flushed before _exit.
        result_queue.close()
        result_queue.join_thread()
    finally:
        # os._exit skips interpreter teardown, which can hang on gloo/OpenMP threads. Run the
        # multiprocessing finalizers first: they unlink named semaphores that libraries created in
        # this process (tqdm's lock, made under torch.compile), which would otherwise be reported
        # as leaked by the resource tracker.
        try:
            multiprocessing.util._run_finalizers()
        except Exception:  # noqa: BLE001 - best effort; exiting matters more
            pass
        os._exit(0)


def _check_module_level(fn: Callable) -> None:
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname or module is None:
        raise TypeError(
            f"run_ranks needs a module-level function (spawned processes import it by name), "
            f"got {fn!r}; define it at the top level of an importable module"
        )
    if module == "__main__":
        raise TypeError(
            f"run_ranks got {qualname} from __main__; spawned processes cannot always re-import "
            "__main__: move the function into an importable module"
        )


def _stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be a module-level function of an importable module and its return value must be
    ``torch.save``-able (tensors, lists, dicts, numbers). ``args`` are pickled to each rank.
    ``timeout`` bounds the whole run (wall clock, including process start-up) and is also the
    process group's collective timeout. Raises :class:`RankFailedError` or
    :class:`RankTimeoutError`; see the module docstring.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    _check_module_level(fn)

    context = mp.get_context("spawn")
    result_queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, port, backend, timeout, fn, args, result_queue),
            name=f"dit_passes-rank{rank}",
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.start()
        while len(results) < world_size:
            if time.monotonic() > deadline:
                pending = [rank for rank in range(world_size) if rank not in results]
                raise RankTimeoutError(pending, timeout)
            try:
                rank, status, payload = result_queue.get(timeout=_POLL_S)
            except queue_module.Empty:
                _raise_if_died_silently(processes, results, result_queue)
                continue
            if status == "error":
                raise RankFailedError(
                    rank, f"rank {rank} of {world_size} raised:\n{payload}", rank_traceback=payload
                )
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for process in processes:
            process.join(_EXIT_GRACE_S)
    finally:
        _stop(processes)
        result_queue.close()
    return [results[rank] for rank in range(world_size)]


def _raise_if_died_silently(processes, results, result_queue) -> None:
    """Raise for a worker that exited without reporting (its message cannot still be in flight)."""
    for rank, process in enumerate(processes):
        if rank in results or process.is_alive() or process.exitcode is None:
            continue
        # A worker that reported and exited may have its message still queued: look once more.
        try:
            message = result_queue.get(timeout=_POLL_S)
        except queue_module.Empty:
            raise RankFailedError(
                rank,
                f"rank {rank} exited with code {process.exitcode} without reporting a result "
                "(crashed or was killed)",
            ) from None
        # Put it back for the main loop; order does not matter (messages carry their rank).
        result_queue.put(message)
        return
