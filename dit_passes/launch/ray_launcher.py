"""Run a diffusers pipeline (or only its transformer) with dit_passes on N Ray workers, from one script.

    engine = RayLauncher(world_size=2).launch(pipe, passes=[passes.Ulysses(2)])
    images = engine(prompt_embeds=..., num_inference_steps=28).images   # rank 0's result
    engine.shutdown()

    engine = RayLauncher(world_size=2).launch(pipe, passes=[passes.Ulysses(2)], level="transformer")
    pipe.transformer = engine.as_transformer()                           # steps run on the workers
    pipe.to("cuda")                                                      # moves VAE etc., not the proxy

:class:`RayLauncher` holds where and how the workers run and checks what ``launch`` is given; the running
workers are a :class:`~dit_passes.launch.ray_engine.RayEngine` (``dit_passes/launch/ray_engine.py``: how
``launch`` starts Ray, the placement group, the actors and the process group, and what each failure raises).
The engine and its errors are re-exported here.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from .ray_engine import RayEngine, RayLauncherError, RayWorkerDiedError, RayWorkerError, RayWorkerTimeoutError

__all__ = ["RayLauncher", "RayEngine", "RayLauncherError", "RayWorkerError", "RayWorkerDiedError",
           "RayWorkerTimeoutError"]


def _is_pipeline(obj: Any) -> bool:
    try:
        from diffusers import DiffusionPipeline
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DiffusionPipeline)


class RayLauncher:
    """Where and how the workers run. ``launch`` starts them (:mod:`dit_passes.launch.ray_engine`).

    Args:
        world_size: number of ranks (one actor, one device each).
        num_cpus_per_worker: Ray CPUs reserved per actor; also its torch intra-op thread count.
        runtime_env: Ray runtime_env (e.g. ``{"env_vars": {"PYTHONPATH": "/my/src"}}``). Given to
            ``ray.init`` when the launcher starts Ray; with a Ray already running it is set on the
            actors (Ray merges it with the job's), with a warning.
        placement: ``"pack"`` (ranks on as few nodes as possible) or ``"spread"``.
        ray_init_kwargs: extra ``ray.init`` keyword arguments (override the defaults) when starting Ray.
        timeout_s: bound of every wait (start-up steps, each call) and the process group's timeout.
        use_gpus: None = GPUs when the cluster has ``world_size`` of them, else CPU; True / False forces.
        address: a running cluster to connect to when Ray is not initialised here (``ray.init(address=...)``,
            e.g. ``"10.0.0.1:6379"``, ``"auto"``); its resources are the cluster's, so ``num_cpus`` is not given.
        worker_options: Ray actor options for every rank (``.options(**worker_options)``), over the launcher's
            (``num_cpus``, ``num_gpus``, ``max_restarts=0``, the placement-group strategy). The bundles reserve the
            actor's ``num_cpus`` / ``num_gpus`` / ``resources`` / ``memory``; a ``scheduling_strategy`` of yours
            replaces the placement group (none is made). A ``num_gpus`` given here decides GPU vs CPU workers
            unless ``use_gpus`` is set.
        auto_shutdown: whether ``engine.shutdown()`` also stops the Ray this launcher started (or disconnects the
            connection it opened); False leaves Ray running for later launches (the actors are stopped either way).
            A Ray initialised before the launcher is never stopped.
        master_port: the TCP port rank 0 hosts the process group's store on (torch.distributed's rendezvous);
            0: a port the OS picks while binding it (no race with another process taking it in between).
    """

    def __init__(self, world_size: int = 2, num_cpus_per_worker: float = 1, runtime_env: Optional[dict] = None,
                 placement: str = "pack", ray_init_kwargs: Optional[dict] = None, timeout_s: float = 120.0,
                 use_gpus: Optional[bool] = None, address: Optional[str] = None,
                 worker_options: Optional[dict] = None, auto_shutdown: bool = True, master_port: int = 0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise RayLauncherError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(num_cpus_per_worker, (int, float)) or num_cpus_per_worker <= 0:
            raise RayLauncherError(f"num_cpus_per_worker must be > 0, got {num_cpus_per_worker!r}")
        if placement not in ("pack", "spread"):
            raise RayLauncherError(f"placement must be 'pack' or 'spread', got {placement!r}")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise RayLauncherError(f"runtime_env must be a dict (Ray runtime_env), got {type(runtime_env).__name__}")
        if worker_options is not None and not isinstance(worker_options, dict):
            raise RayLauncherError(f"worker_options must be a dict of Ray actor options, got "
                                   f"{type(worker_options).__name__}")
        if address is not None and not isinstance(address, str):
            raise RayLauncherError(f"address must be a Ray cluster address string, got {address!r}")
        if not isinstance(auto_shutdown, bool):
            raise RayLauncherError(f"auto_shutdown must be a bool, got {auto_shutdown!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 <= master_port < 65536:
            raise RayLauncherError(f"master_port must be an int in 0 .. 65535 (0: one the OS picks), got "
                                   f"{master_port!r}")
        if not timeout_s or timeout_s <= 0:
            raise RayLauncherError(f"timeout_s must be positive seconds, got {timeout_s!r}")
        self.world_size = world_size
        self.num_cpus_per_worker = num_cpus_per_worker
        self.runtime_env = runtime_env
        self.placement = placement
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.timeout_s = float(timeout_s)
        self.use_gpus = use_gpus
        self.address = address
        self.worker_options = dict(worker_options or {})
        self.auto_shutdown = auto_shutdown
        self.master_port = master_port

    def launch(self, pipe_or_factory: Any, passes: Union[Sequence[Any], Callable[[int, int], list]] = (), *,
               transfer: Optional[str] = None, compile: Union[bool, dict] = False, level: str = "pipeline",
               copy_weights: bool = False, extra_modules: Sequence[torch.nn.Module] = (),
               extra_fn: Optional[Callable[[torch.nn.Module, int, int], torch.nn.Module]] = None) -> "RayEngine":
        """Start the workers and load ``pipe_or_factory`` into them; returns a :class:`RayEngine`.

        ``pipe_or_factory``: a diffusers pipeline, a transformer or a list of transformers (``level="transformer"``:
        each is lowered in every worker; ``engine.as_transformer(i)`` runs the i-th, e.g. Wan 2.2's ``transformer``
        and ``transformer_2``), or a zero-argument callable building one of these inside each worker (then
        ``transfer`` is "factory").
        ``passes``: picklable pass objects (each worker unpickles its own) or ``passes_fn(rank, world_size)``.
        ``transfer``: "object_store" (default for objects), "snapshot", "factory" (default for callables).
        ``compile``: True, or a dict of ``torch.compile`` options, compiles each lowered graph in the workers.
        ``copy_weights``: give CPU workers private weight copies instead of views of the shared store.
        ``extra_modules`` (``level="transformer"``, objects): further modules that travel with the transformer(s)
        (a text encoder, a VAE, a ControlNet); each worker replaces each by ``extra_fn(module, rank, world_size)``
        (picklable; e.g. its parallel version) and ``engine.as_module(j)`` calls the j-th there.
        """
        if level not in ("pipeline", "transformer"):
            raise RayLauncherError(f"level must be 'pipeline' or 'transformer', got {level!r}")
        is_object = isinstance(pipe_or_factory, torch.nn.Module) or _is_pipeline(pipe_or_factory) \
            or _is_module_list(pipe_or_factory)
        if transfer is None:
            transfer = "object_store" if is_object else "factory"
        if transfer not in ("object_store", "snapshot", "factory"):
            raise RayLauncherError(f"transfer must be 'object_store', 'snapshot' or 'factory', got {transfer!r}")
        if transfer == "factory" and (is_object or not callable(pipe_or_factory)):
            raise RayLauncherError("transfer='factory' needs a zero-argument callable that builds the pipeline / "
                                   f"transformer in each worker, got a {type(pipe_or_factory).__name__}")
        if transfer != "factory" and not is_object:
            raise RayLauncherError(f"transfer={transfer!r} sends an object: pass a diffusers pipeline or an "
                                   f"nn.Module (got {type(pipe_or_factory).__name__}); for a callable use "
                                   "transfer='factory'")
        if is_object:
            if level == "pipeline" and not _is_pipeline(pipe_or_factory):
                raise RayLauncherError(f"level='pipeline' needs a pipeline; {type(pipe_or_factory).__name__} is a "
                                       "module (or a list): use level='transformer' and engine.as_transformer()")
            if level == "transformer" and _is_pipeline(pipe_or_factory):
                pipe_or_factory = pipe_or_factory.transformer  # only the transformer travels
        extra_modules = list(extra_modules)
        if extra_modules:
            if level != "transformer" or transfer == "factory" or extra_fn is None \
                    or not all(isinstance(m, torch.nn.Module) for m in extra_modules):
                raise RayLauncherError("extra_modules: nn.Modules sent with the transformer(s) (level='transformer', "
                                       "an object, not a factory) and extra_fn(module, rank, world_size)")
            transformers = list(pipe_or_factory) if isinstance(pipe_or_factory, (list, tuple)) else [pipe_or_factory]
            pipe_or_factory = transformers + extra_modules
        passes_blob = self._check_passes(passes)
        engine = RayEngine(self, level)
        engine._extra = (len(extra_modules), extra_fn)
        try:
            engine._start(pipe_or_factory, transfer, passes_blob, compile, copy_weights)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    @staticmethod
    def _check_passes(passes: Any) -> Any:
        from ray import cloudpickle
        if not callable(passes):
            passes = list(passes)
        try:
            cloudpickle.dumps(passes)
        except Exception as exc:  # noqa: BLE001
            raise RayLauncherError(f"passes must be picklable (each worker gets its own copy): {type(exc).__name__}: "
                                   f"{exc}; or give passes_fn(rank, world_size) -> list that builds them") from exc
        return passes


def _is_module_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, torch.nn.Module) for m in obj)
