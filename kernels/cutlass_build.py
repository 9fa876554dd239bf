"""Building the CUTLASS C-ABI libraries (``w4a4_cutlass.cu``, ``w4a8_lut_cutlass.cu``): one description each
(:class:`CutlassLibrary`), one build procedure.

A library is compiled with nvcc, one object per tile config (``-D<config_macro>=i``, in parallel), linked into one
shared object with static cudart and no torch, against the ``nvidia-cutlass`` headers with the library's header
patches put first on the include path. It is cached under ``$DIT_PASSES_CUTLASS_CACHE/<key>/`` (default
``~/.cache/dit_passes/cutlass``), key = sha256 of the source, the patched headers, the flags, the configs and the
CUTLASS and nvcc versions, with ``build.json``, ``build.log`` (ptxas registers / spills) and ``command.txt``. A
machine without nvcc reuses a library built elsewhere from the same source, headers and flags.

Environment (read through ``dit_passes.infra.env``): ``DIT_PASSES_CUTLASS_CACHE``, ``DIT_PASSES_CUTLASS_INCLUDE`` (a
directory holding ``cutlass/`` and ``cute/`` instead of the pip package), ``CUDA_HOME`` / ``CUDA_PATH`` (nvcc). The
number of parallel nvcc jobs is :func:`build`'s ``jobs`` argument.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Tuple

from dit_passes.infra import env

PIP_HINT = "pip install nvidia-cutlass==4.2.0.0"
NVCC_FLAGS = ["-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
              "-Xcompiler", "-fvisibility=hidden", "-DNDEBUG", "-Xptxas", "-v"]
_NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)
# The fields naming a build: a library is reused when all of them match (nvcc_version excepted where
# this machine has no nvcc: a library built elsewhere from the same source, header and flags).
_KEY_FIELDS = ("layout", "source_sha256", "header_sha256", "flags", "configs", "cutlass_version", "nvcc_version")

# (old, new, expected count) replacements of one header's text
Patch = Tuple[str, str, int]


class CutlassUnavailable(RuntimeError):
    """CUTLASS headers, nvcc, or a Hopper GPU are missing."""


@dataclass(frozen=True)
class CutlassLibrary:
    """One C-ABI library: ``source`` (a path, or a file name next to this module), its tile ``configs`` (one
    object each, selected by ``-D<config_macro>=i``), ``patches``: (header path under the include directory,
    its replacements) pairs, applied to a copy put first on the include path."""
    name: str
    source: str
    configs: Tuple[str, ...]
    config_macro: str
    patches: Tuple[Tuple[str, Tuple[Patch, ...]], ...] = ()
    layout: str = "one-object-per-config-v1"

    @property
    def source_path(self) -> str:
        return self.source if os.path.isabs(self.source) else os.path.join(os.path.dirname(__file__), self.source)


# ------------------------------------------------------------------------------------------------ discovery
def _is_include_dir(d: Optional[str]) -> bool:
    return bool(d) and os.path.isfile(os.path.join(d, "cutlass", "cutlass.h")) and \
        os.path.isfile(os.path.join(d, "cute", "tensor.hpp"))


def find_cutlass_include() -> str:
    """The directory holding ``cutlass/`` and ``cute/`` headers: ``$DIT_PASSES_CUTLASS_INCLUDE``,
    ``$CUTLASS_PATH/include``, or the ``nvidia-cutlass`` wheel's ``<site>/cutlass_library/source/include``
    (``importlib.util.find_spec``, so ``pip install --target DIR`` + ``PYTHONPATH=DIR`` works, or the
    distribution's file list)."""
    given, cp = env.cutlass_include(), env.cutlass_path()
    tried = ([given] if given else []) + ([os.path.join(cp, "include")] if cp else [])
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    tried += [os.path.join(loc, "source", "include") for loc in (spec.submodule_search_locations or [])] if spec else []
    for d in tried:
        if _is_include_dir(d):
            return os.path.abspath(d)
    try:
        from importlib import metadata
        dist = metadata.distribution("nvidia-cutlass")
        for f in dist.files or []:
            if str(f).replace("\\", "/").endswith("source/include/cutlass/cutlass.h"):
                d = os.path.dirname(os.path.dirname(str(dist.locate_file(f))))
                if _is_include_dir(d):
                    return os.path.abspath(d)
    except Exception:  # noqa: BLE001 - metadata lookup is best effort
        pass
    raise CutlassUnavailable(
        "CUTLASS headers not found (looked for cutlass/cutlass.h and cute/tensor.hpp in "
        f"{tried or 'the cutlass_library package'}); install them with `{PIP_HINT}` "
        "(or set DIT_PASSES_CUTLASS_INCLUDE to a directory holding cutlass/ and cute/)")


def cutlass_version(include_dir: Optional[str] = None) -> str:
    inc = include_dir or find_cutlass_include()
    try:
        txt = open(os.path.join(inc, "cutlass", "version.h")).read()
        parts = [re.search(rf"#define CUTLASS_{k} (\d+)", txt) for k in ("MAJOR", "MINOR", "PATCH")]
        return ".".join(p.group(1) for p in parts if p)
    except OSError:
        return "unknown"


def find_nvcc() -> str:
    """``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``, ``nvcc`` on PATH, ``/usr/local/cuda/bin/nvcc``."""
    cands = [os.path.join(home, "bin", "nvcc") for home in env.cuda_homes()]
    which = shutil.which("nvcc")
    cands += ([which] if which else []) + list(_NVCC_FALLBACKS)
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise CutlassUnavailable(f"nvcc not found (tried {cands}); install the CUDA toolkit (12.4+, e.g. "
                             "13.0) and set CUDA_HOME or put nvcc on PATH")


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def cache_root() -> str:
    given = env.cutlass_cache()
    if given:
        return os.path.abspath(given)
    base = env.xdg_cache_home() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dit_passes", "cutlass")


def patched_header(include_dir: str, header: str, patches: Tuple[Patch, ...]) -> str:
    """The text of ``header`` with ``patches`` applied; refuses (naming the pip command) when a replacement's
    text is not found the expected number of times: another CUTLASS version."""
    path = os.path.join(include_dir, header)
    try:
        text = open(path).read()
    except OSError as e:
        raise CutlassUnavailable(f"{path} missing: this CUTLASS lacks a header the kernel needs; `{PIP_HINT}`") from e
    for old, new, count in patches:
        found = text.count(old)
        if found != count:
            raise CutlassUnavailable(
                f"cannot patch {path}: expected {count} occurrence(s) of {old[:60]!r}, found {found} "
                f"(the patch targets CUTLASS 4.2.0, found {cutlass_version(include_dir)}; `{PIP_HINT}`)")
        text = text.replace(old, new)
    return text


# ------------------------------------------------------------------------------------------------ build
def _manifest(lib: CutlassLibrary, include_dir: str, nvcc: Optional[str]):
    headers = {h: patched_header(include_dir, h, p) for h, p in lib.patches}
    man = {"layout": lib.layout, "source_sha256": hashlib.sha256(open(lib.source_path, "rb").read()).hexdigest(),
           "header_sha256": hashlib.sha256("".join(headers.values()).encode()).hexdigest(),
           "flags": NVCC_FLAGS, "configs": list(lib.configs), "cutlass_version": cutlass_version(include_dir),
           "nvcc_version": _nvcc_version(nvcc) if nvcc else None}
    key = hashlib.sha256(json.dumps([man[k] for k in _KEY_FIELDS]).encode()).hexdigest()[:20]
    return key, man, headers


def _find_built(lib: CutlassLibrary, key: str, man: dict) -> Optional[str]:
    root = cache_root()
    so = os.path.join(root, key, lib.name + ".so")
    if os.path.isfile(so):
        return so
    if man["nvcc_version"] is None and os.path.isdir(root):
        for d in sorted(os.listdir(root)):
            try:
                other = json.load(open(os.path.join(root, d, "build.json")))
            except (OSError, ValueError):
                continue
            so = os.path.join(root, d, lib.name + ".so")
            if all(other.get(k) == man[k] for k in _KEY_FIELDS if k != "nvcc_version") and os.path.isfile(so):
                return so
    return None


def _nvcc_or_none() -> Optional[str]:
    try:
        return find_nvcc()
    except CutlassUnavailable:
        return None


def built_library(lib: CutlassLibrary) -> Optional[str]:
    """The cached library for this source / headers / flags (see :func:`build`) or None; never compiles."""
    try:
        key, man, _ = _manifest(lib, find_cutlass_include(), _nvcc_or_none())
        return _find_built(lib, key, man)
    except Exception:  # noqa: BLE001 - a query
        return None


def build(lib: CutlassLibrary, verbose: bool = False, force: bool = False, jobs: Optional[int] = None) -> str:
    """Compile ``lib`` (cached; module docstring) and return the path of its shared library."""
    include_dir = find_cutlass_include()
    nvcc = _nvcc_or_none()
    key, man, headers = _manifest(lib, include_dir, nvcc)
    hit = None if force else _find_built(lib, key, man)
    if hit:
        return hit
    if nvcc is None:
        find_nvcc()  # raises CutlassUnavailable naming what was tried
    root = cache_root()
    out_dir = os.path.join(root, key)
    so_path = os.path.join(out_dir, lib.name + ".so")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(root, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(so_path) and not force:
            return so_path
        t0 = time.time()
        patched = os.path.join(out_dir, "patched_include")
        for header, text in headers.items():
            os.makedirs(os.path.dirname(os.path.join(patched, header)), exist_ok=True)
            with open(os.path.join(patched, header), "w") as f:
                f.write(text)
        tag = f"tmp{os.getpid()}"
        objs = [os.path.join(out_dir, f"{name}.{tag}.o") for name in lib.configs]
        cmds = [[nvcc, *NVCC_FLAGS, f"-D{lib.config_macro}={i}", "-I" + patched, "-I" + include_dir,
                 "-c", "-o", obj, lib.source_path] for i, obj in enumerate(objs)]
        tmp = so_path + "." + tag
        link = [nvcc, "-shared", "-arch=sm_90a", "-o", tmp, *objs]
        with open(os.path.join(out_dir, "command.txt"), "w") as f:
            f.write("\n".join(" ".join(c) for c in cmds + [link]) + "\n")
        if jobs is None:
            jobs = min(len(cmds), os.cpu_count() or 1)
        if verbose:
            print(f"[{lib.name}] compiling {len(cmds)} configs, {jobs} at a time, into {out_dir}",
                  file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max(1, jobs)) as ex:
            procs = list(ex.map(lambda c: subprocess.run(c, capture_output=True, text=True), cmds))
        if all(p.returncode == 0 for p in procs):
            procs.append(subprocess.run(link, capture_output=True, text=True))
        log = "".join(f"==== {' '.join(p.args[-4:])}\n{p.stdout}{p.stderr}" for p in procs)
        with open(os.path.join(out_dir, "build.log"), "w") as f:
            f.write(log)
        for path in objs:
            if os.path.exists(path):
                os.remove(path)
        if verbose:
            print(log, file=sys.stderr, flush=True)
        bad = [p for p in procs if p.returncode != 0]
        if bad:
            if os.path.exists(tmp):
                os.remove(tmp)
            text = bad[0].stdout + bad[0].stderr
            errs = [ln for ln in text.splitlines() if "error" in ln.lower()][:20]
            raise RuntimeError(f"nvcc failed (exit {bad[0].returncode}); log: {out_dir}/build.log\n"
                               + "\n".join(errs or text.splitlines()[-40:]))
        os.replace(tmp, so_path)
        with open(os.path.join(out_dir, "build.json"), "w") as f:
            json.dump({**man, "key": key, "build_s": round(time.time() - t0, 1), "jobs": jobs}, f, indent=1)
    return so_path
