"""Run a function on N CPU processes joined by a torch.distributed process group (tests only).

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` processes (``spawn``
start method: no state inherited from the driver), joined by a process group (gloo by default, on a free port of
127.0.0.1), and returns the ranks' return values as a list in rank order.

The processes are a pool, reused by the next call of the same world size and backend: starting a rank (a Python
process importing torch, diffusers and the library, then its first capture) costs seconds of CPU, and a test
suite makes dozens of such calls. Each call runs as in a fresh process as far as a test can tell: the driver's
current environment variables are applied first, torch's default generator is re-seeded with a fresh
process's seed and the rank runs one thread. ``fresh=True`` spawns new
processes for the call and ends them after it.

Guarantees:

* a rank that raises -> the driver raises :class:`RankFailedError` carrying that rank's traceback,
  and its pool's processes (the others may be stuck in a collective waiting for it) are killed, the
  other pools closed;
* no result from every rank within ``timeout`` seconds -> :class:`RankTimeoutError` naming the ranks
  that did not finish; the processes are killed, the other pools closed;
* a rank that dies without reporting (segfault, ``os._exit``) -> :class:`RankFailedError` with its
  exit code;
* no process outlives the driver: pools are ended at its exit (and a rank whose driver died ends itself),
  and after a failure no worker is left.

Return values travel as ``torch.save`` bytes, not as shared-memory tensors: a shared-memory tensor would need
its sender to keep it alive while the driver unpickles it.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import io
import itertools
import multiprocessing.util
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Tuple

import torch
import torch.multiprocessing as mp

from ..infra import env

__all__ = ["RankFailedError", "RankTimeoutError", "run_ranks"]

# How long the driver blocks on the result queue between liveness checks (seconds).
_POLL_S = 0.05
# Grace period for a worker to exit when its pool is closed, before it is killed (seconds).
_EXIT_GRACE_S = 5.0
# The seed of torch's default generator in a fresh process: each call starts from it, as a fresh rank would.
_FRESH_PROCESS_SEED = 67280421310721
# A pool's process-group timeout: a hang is caught by the driver's deadline (each call's ``timeout``), which
# kills the pool; this only has to outlast the longest call.
_POOL_PG_TIMEOUT_S = 3600.0


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


def _apply_env(values: Dict[str, str]) -> None:
    env.replace_all(values)


def _worker(rank, world_size, port, backend, pg_timeout, tasks, result_queue, driver_pid):
    """Body of one pooled rank: init the process group once, then run each task put on ``tasks`` (``None``
    ends the loop) and report it; tear down and ``os._exit`` at the end or when the driver is gone."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            if backend == "nccl":
                # One GPU per rank, chosen before NCCL creates its communicators.
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout))
        except BaseException:  # noqa: BLE001 - every failure must reach the driver
            result_queue.put((None, rank, "error", traceback.format_exc(), 0.0))
            return
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue_module.Empty:
                if os.getppid() != driver_pid:  # the driver died without closing the pool
                    return
                continue
            except BaseException:  # noqa: BLE001 - e.g. the function's module fails to import here
                result_queue.put((None, rank, "error", traceback.format_exc(), 0.0))
                return
            if task is None:
                return
            job, fn, args, values = task  # (unpickling fn imported its module: any import-time settings ran)
            _apply_env(values)
            torch.manual_seed(_FRESH_PROCESS_SEED)
            torch.set_num_threads(1)  # after the import, as a fresh rank sets it: one thread per rank
            cpu = time.process_time()
            try:
                message = (job, rank, "ok", _to_bytes(fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - every failure must reach the driver
                message = (job, rank, "error", traceback.format_exc())
            result_queue.put(message + (time.process_time() - cpu,))
            if "torch._dynamo" in sys.modules:  # compiled code of this call: not the next call's business
                torch._dynamo.reset()
            gc.collect()
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not hide the result
            pass
        # put() hands messages to a feeder thread; wait until they are flushed before _exit.
        result_queue.close()
        result_queue.join_thread()
        # os._exit skips interpreter teardown, which can hang on gloo/OpenMP threads. Run the
        # multiprocessing finalizers first: they unlink named semaphores that libraries created in
        # this process (tqdm's lock, made under torch.compile), which would otherwise be reported
        # as leaked by the resource tracker.
        try:
            multiprocessing.util._run_finalizers()
        except Exception:  # noqa: BLE001 - best effort; exiting matters more
            pass
        os._exit(0)


class _RankPool:
    """``world_size`` spawned ranks joined by one process group, each reading tasks from its own queue."""

    def __init__(self, world_size: int, backend: str):
        context = mp.get_context("spawn")
        self.world_size, self.results = world_size, context.Queue()
        self.tasks = [context.Queue() for _ in range(world_size)]
        port = _free_port()
        self.processes = [
            context.Process(target=_worker, name=f"dit_passes-rank{rank}",
                            args=(rank, world_size, port, backend, _POOL_PG_TIMEOUT_S, self.tasks[rank],
                                  self.results, os.getpid()))
            for rank in range(world_size)
        ]
        self.closed = False
        for process in self.processes:
            process.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for q in self.tasks:
                q.put(None)
            for process in self.processes:
                process.join(_EXIT_GRACE_S)
        _stop(self.processes)
        for q in [*self.tasks, self.results]:
            q.close()
            q.cancel_join_thread()  # a killed reader leaves items unread: do not wait for them

    def run(self, job: int, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        values = env.snapshot()
        for q in self.tasks:
            q.put((job, fn, args, values))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            if time.monotonic() > deadline:
                raise RankTimeoutError([r for r in range(self.world_size) if r not in results], timeout)
            try:
                got, rank, status, payload, cpu_s = self.results.get(timeout=_POLL_S)
            except queue_module.Empty:
                self._raise_if_died()
                continue
            if status == "error":
                raise RankFailedError(rank, f"rank {rank} of {self.world_size} raised:\n{payload}",
                                      rank_traceback=payload)
            if got == job:  # (an older job's message cannot arrive: a failed job closes the pool)
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                rank_cpu_s[0] += cpu_s
        return [results[rank] for rank in range(self.world_size)]

    def _raise_if_died(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise RankFailedError(rank, f"rank {rank} exited with code {process.exitcode} without reporting a "
                                            "result (crashed or was killed)")


# CPU seconds the ranks spent in calls that reported, summed over ranks (the test session's cost accounting).
rank_cpu_s = [0.0]
# The driver's pools by (world size, backend): test-harness state of this process, ended at its exit.
_pools: Dict[Tuple[int, str], _RankPool] = {}
_jobs = itertools.count()


def close_pools() -> None:
    """End every pooled rank (they also end at the driver's exit)."""
    while _pools:
        _pools.popitem()[1].close(graceful=True)


atexit.register(close_pools)


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
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    ``fn`` must be a module-level function of an importable module and its return value must be
    ``torch.save``-able (tensors, lists, dicts, numbers). ``args`` are pickled to each rank.
    ``timeout`` bounds the whole call (wall clock, including process start-up where the pool is new).
    ``fresh``: new processes for this call alone (see the module docstring). Raises
    :class:`RankFailedError` or :class:`RankTimeoutError`; see the module docstring.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    _check_module_level(fn)
    key = (world_size, backend)
    pool = None if fresh else _pools.get(key)
    if pool is not None and not pool.alive():
        _pools.pop(key).close(graceful=False)
        pool = None
    if pool is None:
        pool = _RankPool(world_size, backend)
        if not fresh:
            _pools[key] = pool
    try:
        return pool.run(next(_jobs), fn, args, timeout)
    except BaseException:
        # the other ranks may wait in a collective for the failed one: end them, and every other pool too,
        # so that no process is left once the error reaches the test
        pool.close(graceful=False)
        _pools.pop(key, None)
        close_pools()
        raise
    finally:
        if fresh:
            pool.close(graceful=True)
