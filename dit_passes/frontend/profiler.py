"""cache-dit's profiler helpers: a ``torch.profiler`` session around a block of code, written as a chrome trace.

Same names, signatures, defaults and files as cache-dit 1.5.3's ``cache_dit.profiler``:

- ``ProfilerContext(enabled=True, activities=None, output_dir=None, profile_name=None, with_stack=True,
  record_shapes=True)``: a context manager; on exit writes ``{output_dir}/{profile_name}[-rank{r}].trace.json.gz``
  (``-rank{r}`` only when ``torch.distributed`` runs more than one rank), ``trace_path`` names it. With ``"MEM"`` in
  ``activities`` and CUDA present it also records the CUDA allocator's history and writes
  ``{profile_name}-rank{r}-memory-{unix time}.pickle`` (``torch.cuda.memory._dump_snapshot``) and ``.txt``
  (``torch.cuda.memory_summary()``).
- ``profile_function(...)``: a decorator profiling each call (``profile_name`` defaults to the function's name).
- ``create_profiler_context(enabled=False, ...)``: builds a ``ProfilerContext`` (disabled unless asked, as there).
- ``get_profiler_output_dir()`` / ``set_profiler_output_dir(path)``: the default ``output_dir`` of later sessions
  (``/tmp/cache_dit_profiles`` at start, cache-dit's).

Differences, each said where it happens: cache-dit refuses to build a session without CUDA or an Ascend NPU; here
a CPU-only machine profiles its CPU activity, and an accelerator activity (``"GPU"`` / ``"CUDA"``) asked for without
CUDA is left out with a warning (as is ``"MEM"``, whose memory history is CUDA's allocator). Ascend NPUs are not
supported by dit_passes. cache-dit keeps the default directory in the environment variable
``CACHE_DIT_TORCH_PROFILER_DIR``; settings are arguments here, so ``set_profiler_output_dir`` keeps it in this
process (the one mutable default of this module, as cache-dit's is process-wide).
"""
from __future__ import annotations

import functools
import logging
import pathlib
import time
from typing import Any, Callable, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)

_DEFAULT_DIR = "/tmp/cache_dit_profiles"  # cache-dit's default, so traces land where a cache-dit user looks
_OUTPUT_DIR: Dict[str, str] = {"path": _DEFAULT_DIR}  # process-wide, as cache-dit's environment variable
_ACCELERATOR_NAMES = ("GPU", "CUDA")
_KNOWN = ("CPU", "MEM") + _ACCELERATOR_NAMES


def get_profiler_output_dir() -> str:
    """The directory a ``ProfilerContext`` without ``output_dir`` writes to."""
    return _OUTPUT_DIR["path"]


def set_profiler_output_dir(path: str) -> None:
    """Make ``path`` the default ``output_dir`` of the sessions built after this call."""
    _OUTPUT_DIR["path"] = str(path)


def _world() -> tuple:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ProfilerContext:
    """A ``torch.profiler.profile`` session written as a gzip chrome trace on exit (see the module docstring)."""

    def __init__(self, enabled: bool = True, activities: Optional[List[str]] = None, output_dir: Optional[str] = None,
                 profile_name: Optional[str] = None, with_stack: bool = True, record_shapes: bool = True):
        self.enabled = enabled
        self.activities = list(activities or ["CPU", "GPU"])
        unknown = [a for a in self.activities if a not in _KNOWN]
        if unknown:  # cache-dit drops them silently: a typo would profile nothing
            raise ValueError(f"ProfilerContext(activities=...): unknown {unknown}; use any of {list(_KNOWN)}")
        self.output_dir = pathlib.Path(output_dir or get_profiler_output_dir()).expanduser()
        self.profile_name = profile_name or f"profile_{int(time.time())}"
        self.with_stack = with_stack
        self.record_shapes = record_shapes
        self.profiler: Optional[torch.profiler.profile] = None
        self.trace_path: Optional[pathlib.Path] = None
        self.memory_snapshot_path: Optional[pathlib.Path] = None
        self._track_memory = False

    def _torch_activities(self) -> list:
        cuda = torch.cuda.is_available()
        out = [torch.profiler.ProfilerActivity.CPU] if "CPU" in self.activities else []
        accelerator = [a for a in self.activities if a in _ACCELERATOR_NAMES]
        if accelerator and cuda:
            out.append(torch.profiler.ProfilerActivity.CUDA)
        elif accelerator:
            logger.warning("ProfilerContext: activities %s need CUDA, which this machine lacks; profiling %s only",
                           accelerator, [a for a in self.activities if a == "CPU"] or "nothing")
        self._track_memory = "MEM" in self.activities and cuda
        if "MEM" in self.activities and not cuda:
            logger.warning("ProfilerContext: activity 'MEM' records the CUDA allocator's history; no CUDA here, "
                           "so no memory snapshot is written")
        return out

    def __enter__(self) -> "ProfilerContext":
        if not self.enabled:
            return self
        self.output_dir.mkdir(parents=True, exist_ok=True)
        activities = self._torch_activities()
        if not activities:
            return self
        rank, world = _world()
        self.trace_path = self.output_dir / ("-".join([self.profile_name] + ([f"rank{rank}"] if world > 1 else []))
                                             + ".trace.json.gz")
        if self._track_memory:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        self.profiler = torch.profiler.profile(activities=activities, with_stack=self.with_stack,
                                               record_shapes=self.record_shapes)
        self.profiler.start()
        logger.info("Started profiling (activities %s); the trace goes to %s", self.activities, self.trace_path)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if not self.enabled:
            return
        if self.profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()
            self.profiler.export_chrome_trace(str(self.trace_path))  # gzip, from the .gz suffix
            logger.info("Profiling completed. Trace saved to: %s", self.trace_path)
        if self._track_memory:
            rank, _ = _world()
            stem = self.output_dir / f"{self.profile_name}-rank{rank}-memory-{int(time.time())}"
            self.memory_snapshot_path = stem.with_suffix(".pickle")
            torch.cuda.memory._dump_snapshot(str(self.memory_snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
            stem.with_suffix(".txt").write_text(torch.cuda.memory_summary())
            logger.info("Memory snapshot saved to: %s", self.memory_snapshot_path)


def profile_function(enabled: bool = True, activities: Optional[List[str]] = None, output_dir: Optional[str] = None,
                     profile_name: Optional[str] = None, with_stack: bool = False,
                     record_shapes: bool = True) -> Callable[[Callable], Callable]:
    """A decorator running each call of the function in a ``ProfilerContext`` named ``profile_name`` or after the
    function."""
    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with ProfilerContext(enabled=enabled, activities=activities, output_dir=output_dir,
                                 profile_name=profile_name or func.__name__, with_stack=with_stack,
                                 record_shapes=record_shapes):
                return func(*args, **kwargs)
        return wrapper
    return decorator


def create_profiler_context(enabled: bool = False, activities: Optional[List[str]] = None,
                            output_dir: Optional[str] = None, profile_name: Optional[str] = None,
                            **kwargs: Any) -> ProfilerContext:
    """A ``ProfilerContext`` (``kwargs``: its ``with_stack`` / ``record_shapes``); disabled unless ``enabled``."""
    return ProfilerContext(enabled=enabled, activities=activities, output_dir=output_dir, profile_name=profile_name,
                           **kwargs)
