"""The driver's handle on launched Ray workers: :class:`RayEngine` (start-up, bounded waits, calls, shutdown)
and the errors it raises. Built by :meth:`dit_passes.launch.ray_launcher.RayLauncher.launch`, which checks the
input; the actors are :class:`~dit_passes.launch.workers.RankWorker`.

Start-up (``RayEngine._start``): starts Ray if it is not running (``ray.init(num_cpus=..., include_dashboard=False,
_temp_dir=<short /tmp path>)`` with ``RAY_AUTH_MODE=disabled``), or with ``address`` connects to that running
cluster (``ray.init(address=...)``; ``shutdown()`` disconnects, the cluster keeps running); a Ray the user
initialised is used as is. It reserves a placement group of one bundle per rank (PACK or SPREAD; each bundle
holds what one actor asks for), starts one actor per rank (``num_gpus=1`` each when the cluster has enough GPUs,
else CPU workers; ``worker_options`` go to the actors' ``.options(...)`` over these), joins them in a process group
(nccl / gloo) that rendezvouses at rank 0's node IP on a free port found there, transfers the model
(see :mod:`dit_passes.launch.transfer`), and applies ``compile_dit(transformer, passes)`` in every
worker. No class is replaced: the engine and the proxy are new objects.

Failures: every driver wait is bounded (``timeout_s``). A worker that raises -> :class:`RayWorkerError`
with its rank and traceback; one that dies -> :class:`RayWorkerDiedError`, naming its rank, pid and node (a
worker on the driver's node whose process is gone is seen within about a second, also while its peers wait for
it in a collective; elsewhere when Ray reports the actor dead); no answer in time ->
:class:`RayWorkerTimeoutError`. After a death or a timeout (ranks may be stuck in a collective) the
engine is *broken*: later calls raise at once; ``shutdown()`` always works (it kills the actors).
"""
from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

from ..infra import env
from . import transfer as _transfer
from .workers import RankWorker
from .wrappers import RayModuleProxy, RayTransformerProxy

if TYPE_CHECKING:
    from .ray_launcher import RayLauncher

__all__ = ["RayEngine", "RayLauncherError", "RayWorkerError", "RayWorkerDiedError", "RayWorkerTimeoutError"]

# After one rank fails, how long to wait for the others to report (seconds): if all raised the same
# Python error the group is still in step and the engine stays usable.
_PEER_GRACE_S = 5.0
# How often a wait looks for workers of this node whose process is gone (seconds): Ray reports a killed worker
# only once its raylet and GCS have noticed, which on a loaded machine can take longer than the peers' grace.
_POLL_S = 1.0


class RayLauncherError(RuntimeError):
    """Bad launcher input, or the engine cannot run (broken, shut down, wrong level)."""


class RayWorkerError(RuntimeError):
    """A worker raised; ``rank`` is the first failing rank, ``worker_traceback`` its traceback text."""

    def __init__(self, rank: int, message: str, worker_traceback: str = ""):
        self.rank = rank
        self.worker_traceback = worker_traceback
        super().__init__(message)


class RayWorkerDiedError(RayWorkerError):
    """A worker process died (crash, ``os._exit``, a kill signal, OOM kill) during a call; ``pid`` is its process
    id (None when it died before reporting one)."""

    def __init__(self, rank: int, message: str, worker_traceback: str = "", pid: Optional[int] = None):
        self.pid = pid
        super().__init__(rank, message, worker_traceback)


class RayWorkerTimeoutError(TimeoutError):
    """Not every rank answered within the timeout; ``pending_ranks`` did not."""

    def __init__(self, pending_ranks: List[int], what: str, timeout_s: float):
        self.pending_ranks = pending_ranks
        super().__init__(f"{what}: ranks {pending_ranks} did not answer within {timeout_s:g} s (a hang, e.g. a "
                         "collective that not every rank entered); the engine is broken: call shutdown()")


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is an optional dependency
        raise RayLauncherError("RayLauncher needs Ray: pip install 'ray[default]'") from exc
    return ray


class RayEngine:
    """The launched workers. Pipeline level: call it like the pipeline. Transformer level: ``as_transformer()``.

    ``startup`` holds the start-up timings (seconds) and ``transfer_report`` how the model travelled.
    """

    def __init__(self, launcher: RayLauncher, level: str):
        self.world_size = launcher.world_size
        self.level = level
        self.timeout_s = launcher.timeout_s
        self._launcher = launcher
        self._actors: List[Any] = []
        self._pg = None
        self._owns_ray = False
        self._ray_temp_dir: Optional[str] = None
        self._snapshot_dir: Optional[tempfile.TemporaryDirectory] = None
        self._broken: Optional[str] = None
        self._closed = False
        self._proxies: Dict[int, RayTransformerProxy] = {}
        self._module_proxies: Dict[int, RayModuleProxy] = {}
        self._extra: tuple = (0, None)  # (how many extra modules, extra_fn)
        self._info: Dict[str, Any] = {}
        self._node_ip: Optional[str] = None  # the driver's node, whose worker processes a wait can see
        self.startup: Dict[str, float] = {}
        self.transfer_report: Dict[str, Any] = {}
        self.backend: Optional[str] = None
        self.use_gpus = False
        atexit.register(self.shutdown)

    # -- start-up --------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        ray = _ray()
        launcher = self._launcher
        if ray.is_initialized():
            if launcher.runtime_env:
                warnings.warn("Ray was initialised before RayLauncher: runtime_env is set on the launcher's actors "
                              "only (merged with the job's), not job-wide; put it in your ray.init(runtime_env=...) "
                              "to apply it everywhere", stacklevel=4)
            if launcher.address is not None:
                warnings.warn(f"Ray was initialised before RayLauncher: address={launcher.address!r} is not used; "
                              "the workers run on the cluster this process is connected to", stacklevel=4)
            return
        if launcher.address is not None:
            # A cluster someone else runs: its resources and its session dir are its own (ray.init refuses
            # num_cpus there), and its authentication mode is the user's environment's, left as it is.
            kwargs = dict(address=launcher.address, runtime_env=launcher.runtime_env, log_to_driver=True)
            kwargs.update(launcher.ray_init_kwargs)
            ray.init(**kwargs)
            self._owns_ray = True  # our connection: shutdown() disconnects it (the cluster keeps running)
            return
        # Unix socket paths are limited to ~107 bytes: keep Ray's session dir short.
        self._ray_temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        kwargs = dict(num_cpus=int(max(1, round(launcher.world_size * launcher.num_cpus_per_worker))),
                      include_dashboard=False, _temp_dir=self._ray_temp_dir, runtime_env=launcher.runtime_env,
                      log_to_driver=True)
        kwargs.update(launcher.ray_init_kwargs)
        # Ray 2.60 turns on token authentication (a token file under $HOME) unless told otherwise; the
        # cluster started here is private to this driver. Set for the processes ray.init spawns only.
        with env.scoped("RAY_AUTH_MODE", "disabled"):
            ray.init(**kwargs)
        self._owns_ray = True

    def _start(self, obj: Any, transfer: str, passes: Any, compile_opts: Any, copy_weights: bool) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        launcher, n = self._launcher, self.world_size
        t0 = time.perf_counter()
        self._init_ray()
        self.startup["ray_init_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        options = self._actor_options(ray.cluster_resources().get("GPU", 0))
        own_strategy = "scheduling_strategy" in options
        if not own_strategy:
            bundle = _bundle(options)
            self._pg = placement_group([dict(bundle) for _ in range(n)], strategy=launcher.placement.upper())
            try:
                ray.get(self._pg.ready(), timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RayLauncherError(
                    f"the cluster cannot hold {n} x {bundle} ({launcher.placement.upper()}) within {self.timeout_s:g} "
                    f"s; free now: {_cpu_gpu(ray.available_resources())} of {_cpu_gpu(ray.cluster_resources())} "
                    "(another engine still running?): lower world_size / num_cpus_per_worker / worker_options or add "
                    "nodes") from None
        actor_cls = ray.remote(RankWorker)
        threads = max(1, int(options["num_cpus"]))
        self._actors = [actor_cls.options(**options, **({} if own_strategy else dict(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank))))
            .remote(rank, n, self.use_gpus, threads) for rank in range(n)]
        infos = self._gather([a.node_info.remote() for a in self._actors], "starting the workers")
        self._info["workers"] = infos
        self.startup["actors_ready_s"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        self.backend = "nccl" if self.use_gpus else "gloo"
        ip = infos[0]["ip"]
        (port,) = self._gather([self._actors[0].open_rendezvous.remote(ip, self.timeout_s, launcher.master_port)],
                               f"opening the rendezvous on rank 0 ({ip})")
        self._gather([a.init_process_group.remote(ip, port, self.backend, self.timeout_s)
                      for a in self._actors], f"process group init at {ip}:{port}")
        self.startup["process_group_s"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        payload, arrays_ref = self._payload(obj, transfer)
        self.startup["driver_pack_s"] = time.perf_counter() - t3
        loaded = self._gather([a.load.remote(payload, arrays_ref, self.level, passes, compile_opts, copy_weights,
                                             *self._extra) for a in self._actors], f"loading the model ({transfer})")
        del arrays_ref  # the workers' tensors keep the store object alive; the driver needs no reference
        self.startup["transfer_and_passes_s"] = time.perf_counter() - t3
        self.startup["total_s"] = time.perf_counter() - t0
        self.transfer_report["workers"] = [r["timings"] | {"memory": r["memory"]} for r in loaded]
        self._info["transformers"] = loaded[0]["transformers"]  # (config, dtype) of each lowered transformer

    def _actor_options(self, cluster_gpus: float) -> Dict[str, Any]:
        """Every rank's actor options: the launcher's, then ``worker_options`` over them. Sets ``use_gpus``."""
        launcher, n = self._launcher, self.world_size
        asked = launcher.worker_options.get("num_gpus")
        if launcher.use_gpus is not None:
            self.use_gpus = bool(launcher.use_gpus)
        else:
            self.use_gpus = bool(asked) if asked is not None else cluster_gpus >= n
        if self.use_gpus and cluster_gpus < n * (asked or 1):
            raise RayLauncherError(f"GPU workers asked for, but the Ray cluster has {cluster_gpus:g} GPUs for "
                                   f"world_size={n} x num_gpus={asked or 1}")
        options: Dict[str, Any] = dict(num_cpus=launcher.num_cpus_per_worker, num_gpus=1 if self.use_gpus else 0,
                                       max_restarts=0)
        if launcher.runtime_env and not self._owns_ray:  # else ray.init took it, job-wide
            options["runtime_env"] = launcher.runtime_env
        options.update(launcher.worker_options)
        return options

    def _payload(self, obj: Any, transfer: str):
        ray = _ray()
        self.transfer_report["path"] = transfer
        if transfer == "factory":
            return ("factory", _transfer.check_factory(obj)), None
        if transfer == "snapshot":
            self._snapshot_dir, spec = _transfer.save_snapshot(obj)
            self.transfer_report["snapshot_dir"] = self._snapshot_dir.name
            return ("snapshot", *spec), None
        packed = _transfer.pack_for_object_store(obj)
        self.transfer_report.update(weights_bytes=packed.nbytes, skeleton_bytes=len(packed.skeleton),
                                    strategies=packed.strategies)
        return ("object_store", packed.skeleton), ray.put(packed.arrays)

    # -- waiting ---------------------------------------------------------------------------------
    def _gather(self, refs: List[Any], what: str) -> List[Any]:
        """Results of one call per rank, in rank order; raises the first failure (see module docstring)."""
        ray = _ray()
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: Dict[int, Any] = {}
        errors: Dict[int, BaseException] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(left, _POLL_S)))
            if not ready:
                gone = self._gone_ranks(sorted(pending.values()))
                if gone:  # killed while the others wait for it (e.g. in a collective): name it, not a peer's error
                    rank = gone[0]
                    self._broken = f"{what}: rank {rank} ({self._where(rank)}) died"
                    raise RayWorkerDiedError(rank, f"{what}: worker rank {rank} of {self.world_size} "
                                             f"({self._where(rank)}) died (its process is gone); the engine is "
                                             "broken: call shutdown() and launch again", pid=self._pid(rank))
                if left > _POLL_S:
                    continue
                if errors:
                    break  # a rank raised and its peers are stuck waiting for it
                self._broken = f"{what}: ranks {sorted(pending.values())} timed out"
                raise RayWorkerTimeoutError(sorted(pending.values()), what, self.timeout_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    errors[rank] = exc
                    deadline = min(deadline, time.monotonic() + _PEER_GRACE_S)
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                    self._broken = f"{what}: rank {rank} ({self._where(rank)}) died"
                    raise RayWorkerDiedError(rank, f"{what}: worker rank {rank} of {self.world_size} "
                                             f"({self._where(rank)}) died ({type(exc).__name__}: {_first_line(exc)}); "
                                             "the engine is broken: call shutdown() and launch again",
                                             pid=self._pid(rank)) from exc
        if errors:
            rank = min(errors)
            exc = errors[rank]
            if pending:
                self._broken = f"{what}: rank {rank} raised while ranks {sorted(pending.values())} waited"
            text = str(exc)
            cause = getattr(exc, "cause", None)
            summary = f"{type(cause).__name__}: {cause}" if cause is not None else _first_line(exc)
            raise RayWorkerError(rank, f"{what}: worker rank {rank} of {self.world_size} raised {summary}"
                                 + (" (the engine is broken: call shutdown())" if self._broken else "")
                                 + f"\n--- worker traceback ---\n{text}", worker_traceback=text) from cause
        return [results[rank] for rank in range(len(refs))]

    def _gone_ranks(self, ranks: List[int]) -> List[int]:
        """Of ``ranks``, those whose worker ran on this node and whose process no longer runs (absent, or a zombie
        its raylet has not reaped yet). Workers on other nodes are left to Ray's own report."""
        workers = self._info.get("workers") or []
        if not workers:
            return []
        if self._node_ip is None:
            self._node_ip = _ray().util.get_node_ip_address()
        return [r for r in ranks if r < len(workers) and workers[r].get("ip") == self._node_ip
                and workers[r].get("pid") and not _process_runs(workers[r]["pid"])]

    def _pid(self, rank: int) -> Optional[int]:
        workers = self._info.get("workers") or []
        return workers[rank].get("pid") if rank < len(workers) else None

    def _where(self, rank: int) -> str:
        """``pid <pid> on <node ip>`` of a rank's worker, as it reported at start-up."""
        workers = self._info.get("workers") or []
        if rank >= len(workers):
            return "not started"
        return f"pid {workers[rank].get('pid')} on {workers[rank].get('ip')}"

    def _check_usable(self) -> None:
        if self._closed:
            raise RayLauncherError("the engine was shut down: launch a new one")
        if self._broken:
            raise RayLauncherError(f"the engine is broken ({self._broken}): call shutdown() and launch again")

    # -- use -------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pipeline level: ``pipeline(**kwargs)`` on every worker; returns rank 0's result (tensors on CPU)."""
        if self.level != "pipeline":
            raise RayLauncherError("this engine runs a transformer: use engine.as_transformer() as pipe.transformer")
        if args:
            raise TypeError("call the engine with keyword arguments (prompt_embeds=..., ...), as pipelines take")
        self._check_usable()
        ray = _ray()
        ref = ray.put(kwargs)  # serialised once, read by every worker
        return self._gather([a.call.remote(ref) for a in self._actors], "pipeline call")[0]

    def as_transformer(self, index: int = 0) -> RayTransformerProxy:
        """Transformer level: the module to put in ``pipe.transformer`` (one proxy per transformer launched;
        ``index``: which of a launched list, e.g. 1 for ``pipe.transformer_2``)."""
        if self.level != "transformer":
            raise RayLauncherError("as_transformer() needs launch(..., level='transformer'); this engine runs the "
                                   "whole pipeline: call the engine instead")
        self._check_usable()
        described = self._info["transformers"]
        if not 0 <= index < len(described):
            raise RayLauncherError(f"as_transformer({index}): this engine runs {len(described)} transformer(s)")
        if index not in self._proxies:
            self._proxies[index] = RayTransformerProxy(self, *described[index], index=index)
        return self._proxies[index]

    def as_module(self, index: int, original: torch.nn.Module) -> RayModuleProxy:
        """The proxy of the ``index``-th extra module (``launch(extra_modules=...)``); ``original``: the main
        process's copy, whose plain attributes (``config``, ``dtype``) the proxy reads."""
        self._check_usable()
        if not 0 <= index < self._extra[0]:
            raise RayLauncherError(f"as_module({index}): this engine runs {self._extra[0]} extra module(s)")
        if index not in self._module_proxies:
            self._module_proxies[index] = RayModuleProxy(self, index, original)
        return self._module_proxies[index]

    def _call_extra(self, index: int, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        self._check_usable()
        ref = _ray().put((list(args), kwargs))
        return self._gather([a.call_extra.remote(index, method, ref) for a in self._actors],
                            f"extra module {index}.{method}")[0]

    def _forward(self, kwargs: Dict[str, Any], context: Optional[str], index: int = 0) -> Any:
        self._check_usable()
        ref = _ray().put(kwargs)
        return self._gather([a.forward.remote(ref, context, index) for a in self._actors], "transformer forward")[0]

    def _new_generation(self, index: Optional[int] = None) -> None:
        self._check_usable()
        self._gather([a.new_generation.remote(index) for a in self._actors], "new_generation")

    def set_passes(self, passes_fn: Callable[[List[Any]], List[Any]], index: int = 0) -> None:
        """On every rank, replace the pass list of the ``index``-th lowered transformer by
        ``passes_fn(current passes)`` (picklable); its graphs are lowered again at their next call, in the same
        workers (no restart: the process group, the weights and the other transformers stay)."""
        self._check_usable()
        self._gather([a.set_passes.remote(index, passes_fn) for a in self._actors], "set_passes")

    def run_on_workers(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        """``fn(worker, *args)`` on every rank (a :class:`~dit_passes.launch.workers.RankWorker`); results by rank."""
        self._check_usable()
        return self._gather([a.run.remote(fn, args) for a in self._actors], f"run_on_workers({fn!r})")

    def memory(self) -> List[Dict[str, int]]:
        """Per-rank memory (bytes): ``peak_rss``, ``rss``, ``rss_anon``, ``rss_shmem``, ``rss_file``."""
        self._check_usable()
        return self._gather([a.memory.remote() for a in self._actors], "memory")

    @property
    def workers(self) -> List[Dict[str, Any]]:
        """Per-rank node IP, rendezvous port (rank 0's), pid, GPU ids."""
        return list(self._info.get("workers", []))

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (killed: a broken engine's may hang), free the placement group, stop Ray if
        this engine started it (unless the launcher's ``auto_shutdown`` is False), delete temporary files. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.shutdown)
        try:
            ray = _ray()
        except RayLauncherError:
            return
        if ray.is_initialized():
            if self._actors and not self._broken:
                with contextlib.suppress(Exception):  # orderly: destroy the process groups first
                    ray.wait([a.close.remote() for a in self._actors], num_returns=len(self._actors), timeout=10)
            for actor in self._actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if self._pg is not None:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(self._pg)
            if self._owns_ray and self._launcher.auto_shutdown:
                ray.shutdown()
            elif self._owns_ray:  # left running (auto_shutdown=False): its session directory stays with it
                self._ray_temp_dir = None
        self._actors, self._pg, self._proxies, self._module_proxies = [], None, {}, {}
        if self._snapshot_dir is not None:
            self._snapshot_dir.cleanup()
            self._snapshot_dir = None
        if self._ray_temp_dir is not None:
            shutil.rmtree(self._ray_temp_dir, ignore_errors=True)
            self._ray_temp_dir = None

    def __enter__(self) -> "RayEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else ("broken" if self._broken else "running")
        return (f"RayEngine(level={self.level!r}, world_size={self.world_size}, backend={self.backend!r}, "
                f"{state})")


def _bundle(options: Dict[str, Any]) -> Dict[str, float]:
    """The placement-group bundle that holds one actor with these options."""
    bundle = {"CPU": options["num_cpus"], **dict(options.get("resources") or {})}
    if options.get("num_gpus"):
        bundle["GPU"] = options["num_gpus"]
    if options.get("memory"):
        bundle["memory"] = options["memory"]
    return bundle


def _cpu_gpu(resources: Dict[str, float]) -> Dict[str, float]:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU")}


def _process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this node exists and is not a zombie (Linux /proc; elsewhere: assumed running,
    so only Ray's report names a dead worker)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc at all: cannot tell
    except (OSError, IndexError):
        return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
