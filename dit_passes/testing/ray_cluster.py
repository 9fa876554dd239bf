"""A local Ray cluster for tests: started with the machine's limits, shut down after, no process left.

``ray.init(num_cpus=2, include_dashboard=False)`` in a fresh temp dir, ``RAY_AUTH_MODE=disabled`` while it runs,
``PYTHONPATH`` for the workers from the caller; on exit Ray is shut down, the environment restored, and every
process whose command line names the temp dir must be gone within ``wait_s`` (else ``AssertionError`` naming
them), so a test never leaves a raylet behind.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Iterator, List

from ..infra import env


def session_processes(session_root: str) -> List[str]:
    """Processes whose command line names ``session_root`` (raylet, gcs, workers, ...), this one excepted."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if session_root in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:120]}")
    return found


def wait_gone(session_root: str, wait_s: float = 15.0) -> List[str]:
    """Wait up to ``wait_s`` for the session's processes to exit; returns those still there."""
    deadline = time.monotonic() + wait_s
    while session_processes(session_root) and time.monotonic() < deadline:
        time.sleep(0.2)
    return session_processes(session_root)


@contextlib.contextmanager
def local_ray_cluster(pythonpath: str, prefix: str = "rayt", init_in_temp_dir: bool = False,
                      wait_s: float = 15.0) -> Iterator[str]:
    """Yields the cluster's temp dir. ``init_in_temp_dir``: run ``ray.init`` from that dir (Ray puts the driver's
    cwd on the workers' path; from the repository root, with a runtime_env of the caller's, that is its root)."""
    import ray
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    old_cwd = os.getcwd()
    with env.scoped("RAY_AUTH_MODE", "disabled"):
        try:
            if init_in_temp_dir:
                os.chdir(temp_dir)
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
        finally:
            os.chdir(old_cwd)
        try:
            yield temp_dir
        finally:
            ray.shutdown()
            left = wait_gone(temp_dir, wait_s)
            shutil.rmtree(temp_dir, ignore_errors=True)
            assert not left, f"Ray processes left behind: {left}"
