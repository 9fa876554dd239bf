"""The per-rank Ray actor body: process group, model loading, compile_dit, calls.

:class:`RankWorker` is a plain class; the :class:`~dit_passes.launch.ray_engine.RayEngine` that
:class:`~dit_passes.launch.ray_launcher.RayLauncher` launches wraps it with ``ray.remote`` when it starts
(importing this module needs no Ray). One instance per rank, in its own process; everything it holds is
per-instance.

Life cycle (each step one actor call, driven by the launcher): ``node_info`` (IP), ``open_rendezvous`` (rank 0
hosts the store) -> ``init_process_group`` -> ``load`` (transfer payload -> object ->
``compile_dit`` on its transformer(s) with this rank's passes, ``extra_fn`` on the extra modules -> device) ->
``call`` / ``forward`` / ``call_extra`` any number of times -> ``close``.
"""
from __future__ import annotations

import datetime
import inspect
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["RankWorker", "memory_status", "map_tensors", "PIPELINE_TRANSFORMERS"]

# Pipeline attributes that hold a denoiser compile_dit wraps (Wan 2.2 has a second one).
PIPELINE_TRANSFORMERS = ("transformer", "transformer_2")


def memory_status() -> Dict[str, int]:
    """This process's memory in bytes from /proc/self/status: peak RSS (VmHWM), RSS and its anonymous
    (private) / shared-memory (e.g. Ray's object store) / file-backed parts."""
    fields = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssAnon": "rss_anon", "RssShmem": "rss_shmem",
              "RssFile": "rss_file"}
    out: Dict[str, int] = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: the peak only
        import resource
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor inside tuples / lists / dicts / diffusers outputs (dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, tuple):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    try:
        from diffusers.utils import BaseOutput
    except ImportError:  # pragma: no cover - diffusers is a dependency
        BaseOutput = ()  # noqa: N806
    if BaseOutput and isinstance(obj, BaseOutput):
        return type(obj)(**{k: map_tensors(v, fn) for k, v in obj.items()})
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj


class RankWorker:
    """One rank. Attributes user code may read (``engine.run_on_workers(fn)`` passes the worker):
    ``rank``, ``world_size``, ``device``, ``obj`` (the pipeline, or the transformer(s) at transformer
    level), ``compiled`` (list of the CompiledDiT modules it runs), ``extras`` (the extra modules, e.g. a text
    encoder or a VAE, as ``extra_fn`` made them), ``timings``; ``forward_hook`` (settable through ``run``):
    ``hook(worker, index, kwargs)`` runs a transformer step in place of ``compiled[index]`` (calibration)."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool, num_threads: int):
        self.rank = rank
        self.world_size = world_size
        self.use_gpu = use_gpu
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU, so it is always cuda:0 here.
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(self.device)
        # One intra-op pool per worker sized to its CPU share: N workers x all cores would oversubscribe.
        torch.set_num_threads(max(1, int(num_threads)))
        self.obj: Any = None
        self.level: Optional[str] = None
        self.compiled: List[torch.nn.Module] = []
        self.extras: List[Any] = []
        self.forward_hook: Optional[Callable[["RankWorker", int, Dict[str, Any]], Any]] = None
        self.timings: Dict[str, float] = {}
        self._compile: Any = False
        self._compiled_graphs: set = set()

    # -- rendezvous ------------------------------------------------------------------------------
    def node_info(self) -> Dict[str, Any]:
        import ray
        return {"ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(),
                "torch_threads": torch.get_num_threads()}

    def open_rendezvous(self, ip: str, timeout_s: float, port: int = 0) -> int:
        """Rank 0: host the process group's store on ``port``, or (0) on a port the OS picks while binding it (a
        port found free and bound later can be taken in between: EADDRINUSE on a busy machine). Returns the port."""
        import torch.distributed as dist
        self._store = dist.TCPStore(ip, port, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return int(self._store.port)

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> str:
        import torch.distributed as dist
        t0 = time.perf_counter()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = getattr(self, "_store", None) or dist.TCPStore(master_addr, master_port, self.world_size,
                                                               is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.timings["process_group_s"] = time.perf_counter() - t0
        return str(dist.get_backend())

    # -- loading ---------------------------------------------------------------------------------
    def load(self, payload: tuple, arrays: Any, level: str, passes: Any, compile_opts: Any,
             copy_weights: bool, n_extra: int = 0, extra_fn: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
        """Build the object from ``payload``, apply compile_dit to its transformer(s), move it to the device.

        ``arrays`` is the object-store dict (Ray resolves the ref before this call, zero-copy) or None.
        ``passes``: a list of passes (already unpickled into this process: fresh objects) or a
        callable ``passes_fn(rank, world_size) -> list`` (given ``module=`` the transformer it is for and ``index=``
        its position when it takes those arguments). ``n_extra``: the last ``n_extra`` modules of a transformer-level
        list are extra modules, each replaced by ``extra_fn(module, rank, world_size)`` (``index=`` its position
        among them when it takes one) instead of lowered.
        """
        from . import transfer
        t0 = time.perf_counter()
        kind = payload[0]
        if kind == "object_store":
            obj = transfer.unpack_from_object_store(payload[1], arrays, copy_weights=copy_weights)
        elif kind == "snapshot":
            obj = transfer.load_snapshot(*payload[1:])
        elif kind == "factory":
            from ray import cloudpickle
            obj = cloudpickle.loads(payload[1])()
        else:
            raise ValueError(f"unknown transfer payload {kind!r}")
        self.timings["build_s"] = time.perf_counter() - t0
        obj = self._select(obj, level, kind)
        if n_extra:
            if level != "transformer" or not isinstance(obj, list) or len(obj) <= n_extra or extra_fn is None:
                raise ValueError("extra modules need level='transformer', a list of transformers + extras, extra_fn")
            obj, extras = obj[:-n_extra], obj[-n_extra:]
            obj = obj if len(obj) > 1 else obj[0]

        t1 = time.perf_counter()
        from dit_passes import compile_dit
        def own_passes(i: int, module: Any) -> list:  # each denoiser its own pass objects: they hold per-graph state
            if callable(passes):
                return passes(self.rank, self.world_size, **_offered(passes, module=module, index=i))
            return list(passes) if i == 0 else _fresh_copy(list(passes))
        if level == "transformer":
            self.compiled = [compile_dit(m, passes=own_passes(i, m))
                             for i, m in enumerate(obj if isinstance(obj, list) else [obj])]
            obj = self.compiled if isinstance(obj, list) else self.compiled[0]
            if n_extra:
                self.extras = [extra_fn(m, self.rank, self.world_size, **_offered(extra_fn, index=j)).to(self.device)
                               for j, m in enumerate(extras)]
        else:
            names = [n for n in PIPELINE_TRANSFORMERS if isinstance(getattr(obj, n, None), torch.nn.Module)]
            for i, name in enumerate(names):
                setattr(obj, name, compile_dit(getattr(obj, name), passes=own_passes(i, getattr(obj, name))))
                self.compiled.append(getattr(obj, name))
            if self.rank != 0 and hasattr(obj, "set_progress_bar_config"):
                obj.set_progress_bar_config(disable=True)  # one progress bar (rank 0's) in the driver's log
        self._compile = compile_opts
        self.timings["passes_s"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        obj = [m.to(self.device) for m in obj] if isinstance(obj, list) else obj.to(self.device)
        self.timings["to_device_s"] = time.perf_counter() - t2
        self.obj, self.level = obj, level
        self.timings["load_s"] = time.perf_counter() - t0
        described = [(dict(c.config) if hasattr(c, "config") else None, c.dtype) for c in self.compiled]
        return {"transformers": described, "timings": dict(self.timings), "memory": memory_status()}

    def _select(self, obj: Any, level: str, kind: str) -> Any:
        if level == "transformer":
            if isinstance(obj, torch.nn.Module):
                return obj
            if isinstance(obj, (list, tuple)) and obj and all(isinstance(m, torch.nn.Module) for m in obj):
                return list(obj)
            inner = getattr(obj, "transformer", None)
            if not isinstance(inner, torch.nn.Module):
                raise TypeError(f"level='transformer' needs a transformer (or a pipeline with .transformer); the "
                                f"{kind} path produced {type(obj).__name__}")
            return inner
        if not any(isinstance(getattr(obj, n, None), torch.nn.Module) for n in PIPELINE_TRANSFORMERS):
            raise TypeError(f"level='pipeline' needs a pipeline with a .transformer; the {kind} path produced "
                            f"{type(obj).__name__} (for a bare transformer use level='transformer')")
        return obj

    # -- calls -----------------------------------------------------------------------------------
    def _to_device(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        return {k: map_tensors(v, lambda t: t.to(self.device)) for k, v in kwargs.items()}

    def _result(self, out: Any) -> Any:
        # Only rank 0's result travels back (the others computed the same thing).
        return map_tensors(out, lambda t: t.detach().to("cpu")) if self.rank == 0 else None

    def call(self, kwargs: Dict[str, Any]) -> Any:
        """Pipeline level: ``pipeline(**kwargs)`` under inference mode."""
        with torch.inference_mode():
            out = self.obj(**self._to_device(kwargs))
        self._compile_new_graphs()
        return self._result(out)

    def forward(self, kwargs: Dict[str, Any], context: Optional[str], index: int = 0) -> Any:
        """Transformer level: one denoising step of the ``index``-th transformer under the driver's cache context."""
        compiled = self.compiled[index]
        with torch.inference_mode():
            if self.forward_hook is not None:
                out = self.forward_hook(self, index, self._to_device(kwargs))
            elif context is None:
                out = compiled(**self._to_device(kwargs))
            else:
                with compiled.cache_context(context):
                    out = compiled(**self._to_device(kwargs))
        self._compile_new_graphs()
        return self._result(out)

    def call_extra(self, index: int, method: str, call: tuple) -> Any:
        """``extras[index].<method>(*args, **kwargs)`` for ``call = (args, kwargs)`` (``"forward"``: the module
        called) under inference mode."""
        args, kwargs = call
        module = self.extras[index]
        fn = module if method == "forward" else getattr(module, method)
        with torch.inference_mode():
            out = fn(*map_tensors(list(args), lambda t: t.to(self.device)), **self._to_device(kwargs))
        return self._result(out)

    def new_generation(self, index: Optional[int] = None) -> None:
        for compiled in self.compiled if index is None else [self.compiled[index]]:
            compiled.new_generation()

    def set_passes(self, index: int, passes_fn: Callable[[List[Any]], List[Any]]) -> None:
        """The ``index``-th transformer's passes become ``passes_fn(its passes)``; lowered again at its next call
        (and compiled again after it with ``compile=True``)."""
        compiled = self.compiled[index]
        compiled.set_passes(passes_fn(compiled.passes))
        self._compiled_graphs = {key for key in self._compiled_graphs if key[0] != id(compiled)}

    def _compile_new_graphs(self) -> None:
        """compile=True: torch.compile each lowered graph once it exists (graphs are lowered at their
        first call, so a signature's first call runs the graph eagerly, later calls compiled)."""
        if not self._compile:
            return
        options = self._compile if isinstance(self._compile, dict) else {}
        for compiled in self.compiled:
            for name, gm in compiled.graphs.items():
                if (id(compiled), name) not in self._compiled_graphs:
                    gm.compile(**options)  # nn.Module.compile: in place, this module only
                    self._compiled_graphs.add((id(compiled), name))

    def run(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fn(worker, *args)`` on this rank (inspection, benchmarks, tests)."""
        return fn(self, *args)

    def memory(self) -> Dict[str, int]:
        return memory_status()

    def close(self) -> None:
        import torch.distributed as dist
        self.obj, self.compiled, self.extras = None, [], []
        if dist.is_initialized():
            dist.destroy_process_group()


def _offered(fn: Callable[..., Any], **optional: Any) -> Dict[str, Any]:
    """The keyword arguments among ``optional`` that ``fn`` names (``module``: the transformer a passes_fn builds
    for; ``index``: which transformer / extra module, so one callable can give each its own)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in optional.items() if k in params}


def _fresh_copy(pass_list: List[Any]) -> List[Any]:
    from ray import cloudpickle
    return cloudpickle.loads(cloudpickle.dumps(pass_list))
