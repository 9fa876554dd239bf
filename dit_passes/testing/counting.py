"""Counting what actually runs: a dispatch mode that counts ops by name and follows ``torch.cond`` into
the branch it takes (so a cached step's skipped collectives or weight loads are not counted)."""
from __future__ import annotations

import collections
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """``with OpCounter(["all_reduce", "onload"]) as c: ...``; then ``c.counts["all_reduce"]``, and
    ``c.counts["cond"]`` for the conditionals taken."""

    supports_higher_order_operators = True

    def __init__(self, kinds: Sequence[str]):
        super().__init__()
        self.kinds = tuple(kinds)
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.higher_order.cond:
            pred, true_fn, false_fn, operands = args
            self.counts["cond"] += 1
            with self:
                return (true_fn if bool(pred) else false_fn)(*operands)
        name = str(func)
        for kind in self.kinds:
            if kind in name:
                self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["OpCounter"]
