"""cache-dit's small process utilities, for scripts that call them through ``import dit_passes as cache_dit``."""
from __future__ import annotations

import contextlib
import gc
import io
import logging
from typing import Iterator, Tuple

import torch


def init_logger(name: str) -> logging.Logger:
    """The logger ``name`` (cache-dit's helper; dit_passes logs under ``"dit_passes"``)."""
    return logging.getLogger(name)


@contextlib.contextmanager
def disable_print() -> Iterator[None]:
    """Drop what ``print`` writes to stdout inside the block (the reference swaps ``builtins.print``; here stdout is
    redirected, so nothing global is patched)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def maybe_empty_cache() -> None:
    """Collect garbage and return the accelerator's cached blocks to the driver (the reference also sleeps 2 s
    around it; nothing here waits)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


def version_tuple(version: str) -> Tuple[int, ...]:
    """``"0.1.0"`` -> ``(0, 1, 0)``: the numeric leading parts of a version string."""
    out = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)
