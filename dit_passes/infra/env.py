"""The process environment: the one module of the library that reads (or sets) environment variables.

Settings that change the graph, the numerics or the memory are arguments of the passes and configs that use them
(``describe()`` shows them, so they key every cache), never variables. What remains here is what a deployment or a
test run sets around the library, not in it -- build paths, tuning-table overrides, debug logging and the test
suite's opt-in -- with one typed accessor each (``dit_passes/DESIGN.md`` lists them):

* ``DIT_PASSES_REUSE_TRACES=1`` -- :func:`reuse_traces`: reuse a captured graph for another instance of the same
  architecture and call (``infra/trace_templates.py``); the test suite's opt-in (``tests/conftest.py``).
* ``DIT_PASSES_TRACE_DIR`` -- :func:`trace_dir`: share those captures between processes through this directory
  (``infra/trace_store.py``; ``.ci/test.sh`` sets it).
* ``DIT_PASSES_CUTLASS_CACHE`` -- :func:`cutlass_cache`: where the CUTLASS libraries are built and cached.
* ``DIT_PASSES_CUTLASS_INCLUDE`` -- :func:`cutlass_include`: a directory holding ``cutlass/`` and ``cute/``
  headers, instead of the nvidia-cutlass pip package's.
* ``DIT_PASSES_W4A4_TABLE`` -- :func:`w4a4_table`: the W4A4 kernel timing table (which kernel and tile config per
  shape), instead of the one beside the built libraries.
* ``DIT_PASSES_CUTLASS_CONFIG`` -- :func:`cutlass_config`: one CUTLASS W4A4 tile config for every shape, over the
  timing table (tuning runs).
* ``DIT_PASSES_CUDA_TRACE=1`` -- :func:`cuda_trace`: print every CUDA / NVRTC call of the CUDA-graph if-node with
  its arguments and return code to stderr.
* ``DIT_PASSES_CAPTURE_LOG=<file>`` -- :func:`capture_log`: append one line per torch.export to this file.

Other tools' variables the library reads are read here too: ``TRITON_INTERPRET``, ``CUDA_HOME`` / ``CUDA_PATH``,
``CUTLASS_PATH``, ``XDG_CACHE_HOME``, ``DIFFUSERS_ATTN_BACKEND``, ``PYTEST_CURRENT_TEST``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

REUSE_TRACES = "DIT_PASSES_REUSE_TRACES"
TRACE_DIR = "DIT_PASSES_TRACE_DIR"
CUTLASS_CACHE = "DIT_PASSES_CUTLASS_CACHE"
CUTLASS_INCLUDE = "DIT_PASSES_CUTLASS_INCLUDE"
W4A4_TABLE = "DIT_PASSES_W4A4_TABLE"
CUTLASS_CONFIG = "DIT_PASSES_CUTLASS_CONFIG"
CUDA_TRACE = "DIT_PASSES_CUDA_TRACE"
CAPTURE_LOG = "DIT_PASSES_CAPTURE_LOG"
VARIABLES = (REUSE_TRACES, TRACE_DIR, CUTLASS_CACHE, CUTLASS_INCLUDE, W4A4_TABLE, CUTLASS_CONFIG, CUDA_TRACE,
             CAPTURE_LOG)


def _text(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


# ------------------------------------------------------------------------------------------- ours
def reuse_traces() -> bool:
    """``DIT_PASSES_REUSE_TRACES=1``: captured graphs are reused across instances of one architecture and call."""
    return os.environ.get(REUSE_TRACES) == "1"


def trace_dir() -> Optional[str]:
    """``DIT_PASSES_TRACE_DIR``: the directory reused captures are shared through between processes, or None."""
    return _text(TRACE_DIR)


def cutlass_cache() -> Optional[str]:
    """``DIT_PASSES_CUTLASS_CACHE``: the CUTLASS build cache directory, or None (the user cache directory's)."""
    return _text(CUTLASS_CACHE)


def cutlass_include() -> Optional[str]:
    """``DIT_PASSES_CUTLASS_INCLUDE``: a directory holding ``cutlass/`` and ``cute/`` headers, or None."""
    return _text(CUTLASS_INCLUDE)


def w4a4_table() -> Optional[str]:
    """``DIT_PASSES_W4A4_TABLE``: the W4A4 kernel timing table's path, or None (beside the built libraries)."""
    return _text(W4A4_TABLE)


def cutlass_config() -> Optional[str]:
    """``DIT_PASSES_CUTLASS_CONFIG``: a CUTLASS W4A4 tile config forced for every shape, or None."""
    return _text(CUTLASS_CONFIG)


def cuda_trace() -> bool:
    """``DIT_PASSES_CUDA_TRACE=1``: trace the CUDA-graph if-node's CUDA / NVRTC calls to stderr."""
    return _flag(CUDA_TRACE)


def capture_log() -> Optional[str]:
    """``DIT_PASSES_CAPTURE_LOG``: the file each torch.export appends a line to, or None."""
    return _text(CAPTURE_LOG)


# ------------------------------------------------------------------------------------ other tools'
def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton runs its kernels in its interpreter (on the CPU)."""
    return _flag("TRITON_INTERPRET")


def cuda_homes() -> list:
    """``CUDA_HOME`` and ``CUDA_PATH`` where set (where nvcc is looked for first)."""
    return [v for v in (_text("CUDA_HOME"), _text("CUDA_PATH")) if v]


def cutlass_path() -> Optional[str]:
    """``CUTLASS_PATH``: a CUTLASS checkout (its ``include/`` holds the headers), or None."""
    return _text("CUTLASS_PATH")


def xdg_cache_home() -> Optional[str]:
    """``XDG_CACHE_HOME``: the user cache directory, or None (``~/.cache``)."""
    return _text("XDG_CACHE_HOME")


def diffusers_attention_backend() -> Optional[str]:
    """``DIFFUSERS_ATTN_BACKEND``: diffusers' attention backend for the process (it changes a captured graph)."""
    return os.environ.get("DIFFUSERS_ATTN_BACKEND")


def current_test() -> str:
    """The pytest node id running now (``PYTEST_CURRENT_TEST``), or ""."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]


# ------------------------------------------------------------------------------------------ setting
def snapshot() -> Dict[str, str]:
    """The whole environment, as a dict (what a pooled rank process takes over, ``testing/multiproc.py``)."""
    return dict(os.environ)


def replace_all(values: Dict[str, str]) -> None:
    """Make the environment exactly ``values`` (a pooled rank process running a task of another environment)."""
    for key in [k for k in os.environ if k not in values]:
        del os.environ[key]
    os.environ.update(values)


@contextlib.contextmanager
def scoped(name: str, value: str) -> Iterator[None]:
    """``name=value`` inside the block (for processes started there, e.g. Ray's), restored after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def set_default(name: str, value: str) -> None:
    """``name=value`` unless it is set (a tool's opt-in for its own process, e.g. ``REUSE_TRACES``)."""
    os.environ.setdefault(name, value)
