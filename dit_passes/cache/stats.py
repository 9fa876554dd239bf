"""Per-call cache records in a device ring buffer; read to the host only when a summary is asked for.

``record`` copies five device scalars of a call (generation id, step, decision, diff, whether a diff was
recorded), and the CFG branch the graph picked where it picks one, into one row of a preallocated device buffer: a
device-to-device copy, no sync. The row index and the context name (or the names of its branches) are host-side. ``summary()`` makes the one sync and returns, per
generation, what cache-dit's ``summary`` reports: cached steps, residual diffs by step with the
reference's percentile set (P00, P25, P50, P75, P95, min, max), and the ``cfg_`` variants for the CFG
branch (context "cfg" or "uncond").
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch

CFG_CONTEXTS = ("cfg", "uncond")
PERCENTILES = (("P00", 0), ("P25", 25), ("P50", 50), ("P75", 75), ("P95", 95))


def diff_statistics(values: List[float]) -> Dict[str, float]:
    """The reference's statistics of recorded diffs (numpy linear percentiles), {} when there are none."""
    if not values:
        return {}
    out = {name: float(np.percentile(values, q)) for name, q in PERCENTILES}
    out["Min"], out["Max"] = float(np.min(values)), float(np.max(values))
    return out


class CacheStats:
    """Ring buffer of the last ``capacity`` calls' records on ``device``."""

    _COLS = ("gen", "step", "cached", "diff", "recorded", "branch")

    def __init__(self, capacity: int = 4096, device: Optional[torch.device] = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"CacheStats: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.device = device
        self._rows: Optional[torch.Tensor] = None
        self._contexts: List[Any] = [None] * capacity  # a context name, or its branches' names
        self._count = 0

    def record(self, context: Any, state: Dict[str, torch.Tensor], use_cache: Optional[torch.Tensor] = None,
               branch: Optional[torch.Tensor] = None) -> None:
        """Append one call: ``state`` is the state returned by ``decide`` (or after ``update_after_branch``).
        ``branch``: the branch the graph picked (a device scalar); ``context`` is then the tuple of the branches'
        names, resolved when the records are read."""
        step = state["step"]
        if self._rows is None:
            self._rows = torch.full((self.capacity, len(self._COLS)), float("nan"), dtype=torch.float64,
                                    device=self.device if self.device is not None else step.device)
        cached = state["use_cache"] if use_cache is None else use_cache
        # one stack: it promotes the int64 / bool / float64 scalars to the row's float64
        row = torch.stack([state["gen"], step, cached, state["diff"].to(torch.float64), state["diff_step"] == step,
                           (branch if branch is not None else step.new_zeros(())).to(step.dtype)])
        pos = self._count % self.capacity
        self._rows[pos].copy_(row, non_blocking=True)
        self._contexts[pos] = context
        self._count += 1

    def clear(self) -> None:
        self._count = 0
        self._contexts = [None] * self.capacity

    @property
    def dropped(self) -> int:
        """Calls overwritten because the ring was full."""
        return max(0, self._count - self.capacity)

    def records(self) -> List[Dict[str, Any]]:
        """All kept records, oldest first (one device-to-host copy)."""
        if self._rows is None or self._count == 0:
            return []
        n = min(self._count, self.capacity)
        start = self._count % self.capacity if self._count > self.capacity else 0
        order = [(start + i) % self.capacity for i in range(n)]
        rows = self._rows.cpu().tolist()
        out = []
        for p in order:
            gen, step, cached, diff, recorded, branch = rows[p]
            ctx = self._contexts[p]
            out.append({"context": ctx if isinstance(ctx, str) else ctx[int(branch)], "generation": int(gen), "step": int(step),
                        "cached": bool(cached), "diff": float(diff) if recorded else None})
        return out

    def summary(self) -> List[Dict[str, Any]]:
        """Per generation (in call order): ``contexts`` -> per-context stats, plus the reference's fields
        ``cached_steps``, ``residual_diffs`` (step string -> diff), ``accumulated_cached_steps``,
        ``residual_diff_stats`` and their ``cfg_`` twins for the CFG context, when the split is unambiguous."""
        gens: Dict[int, Dict[str, Any]] = {}
        for r in self.records():
            g = gens.setdefault(r["generation"], {"generation": r["generation"], "contexts": {}})
            c = g["contexts"].setdefault(r["context"], {"cached_steps": [], "residual_diffs": {}, "executed_steps": 0})
            c["executed_steps"] += 1
            if r["cached"]:
                c["cached_steps"].append(r["step"])
            if r["diff"] is not None:
                c["residual_diffs"].setdefault(str(r["step"]), r["diff"])
        out = []
        for g in gens.values():
            for c in g["contexts"].values():
                c["accumulated_cached_steps"] = len(c["cached_steps"])
                c["residual_diff_stats"] = diff_statistics(list(c["residual_diffs"].values()))
            main = [n for n in g["contexts"] if n not in CFG_CONTEXTS]
            cfg = [n for n in g["contexts"] if n in CFG_CONTEXTS]
            for prefix, names in (("", main), ("cfg_", cfg)):
                if len(names) == 1:
                    c = g["contexts"][names[0]]
                    for k in ("cached_steps", "residual_diffs", "accumulated_cached_steps", "residual_diff_stats"):
                        g[prefix + k] = c[k]
            out.append(g)
        return out

    def summary_string(self) -> str:
        """A table per generation and context, in the reference's layout."""
        lines = []
        head = "| Cache Steps | Diffs P00 | Diffs P25 | Diffs P50 | Diffs P75 | Diffs P95 | Diffs Min | Diffs Max |"
        for g in self.summary():
            for name, c in g["contexts"].items():
                lines.append(f"generation {g['generation']}, context '{name}': executed steps "
                             f"{c['executed_steps']}, cached steps {c['cached_steps']}")
                st = c["residual_diff_stats"]
                if st:
                    lines.append(head)
                    lines.append("|" + "|".join(["-" * 13] + ["-" * 11] * 7) + "|")
                    vals = [st[k] for k in ("P00", "P25", "P50", "P75", "P95", "Min", "Max")]
                    lines.append(f"| {c['accumulated_cached_steps']:<11} | "
                                 + " | ".join(f"{round(v, 3):<9}" for v in vals) + " |")
        if self.dropped:
            lines.append(f"({self.dropped} older calls were dropped from the ring buffer)")
        return "\n".join(lines)


__all__ = ["CacheStats", "diff_statistics", "PERCENTILES"]
