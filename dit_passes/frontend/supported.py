"""cache-dit's ``supported_pipelines`` / ``supported_matrix``, from what dit_passes is tested on.

cache-dit lists the pipelines it has a hand-written block adapter for; dit_passes has no adapters (it finds the
blocks in the traced graph), so its list is the transformers its benchmark shows working: every family of the zoo
whose capture and cache passes equal the eager model (:mod:`dit_passes.models.supported`, from
``bench/results/coverage.json``), named as cache-dit names them (the class's prefix: ``Flux``, ``Wan``, ...).
A diffusers DiT outside the list may well work; the list is what is tested.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from ..models.supported import SUPPORTED

logger = logging.getLogger(__name__)


def supported_pipelines(**kwargs) -> Tuple[int, List[str]]:
    """``(count, names)`` as cache-dit returns them: the pipeline-name prefixes of the tested transformers."""
    if kwargs:  # cache-dit takes and drops any keyword
        raise TypeError(f"supported_pipelines() takes no arguments (got {sorted(kwargs)})")
    names = list(SUPPORTED)
    return len(names), names


def supported_matrix() -> Optional[str]:
    """cache-dit's markdown matrix (``| Model | Cache | CP | TP |`` twice per line, the list split in two halves):
    Cache for every listed name, CP where Ulysses and Ring attention equal the eager model, TP where tensor
    parallelism does. Also logged, as cache-dit does."""
    names = list(SUPPORTED)
    lines = ["| Model | Cache  | CP | TP | Model | Cache  | CP | TP |", "|:---|:---|:---|:---|:---|:---|:---|:---|"]

    def cells(name: str) -> str:
        _, cp, tp = SUPPORTED[name]
        return f"| **🎉{name}** | ✅ | {'✅' if cp else '✖️'} | {'✅' if tp else '✖️'} "

    half = (len(names) + 1) // 2
    for i in range(half):
        right = cells(names[i + half]) if i + half < len(names) else "| **🎉** |  |  |  "
        lines.append(cells(names[i]) + right + "| ")
    matrix = "\n".join(lines)
    logger.info("\nSupported Cache and Parallelism Matrix:\n%s", matrix)
    return matrix
