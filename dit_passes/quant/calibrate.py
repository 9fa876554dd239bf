"""Calibration statistics for PTQ smoothing: the per-input-channel abs-max of linear inputs."""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn


class ActAbsMaxObserver(nn.Module):
    """Identity module that records the running per-channel abs-max of its input's last dimension.

    ``absmax`` (fp32 [C], a buffer) is None until the first call; later calls must have the same C.
    ``num_batches`` counts the calls. Use :meth:`reset` to start over.
    """

    absmax: Optional[torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("absmax", None)
        self.num_batches = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError("ActAbsMaxObserver needs an input with a channel (last) dimension, got a scalar")
        cur = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        if self.absmax is None:
            self.absmax = cur
        elif self.absmax.shape != cur.shape:
            raise ValueError(f"ActAbsMaxObserver saw {self.absmax.shape[0]} channels before and "
                             f"{cur.shape[0]} now; use one observer per linear")
        else:
            self.absmax = torch.maximum(self.absmax, cur.to(self.absmax.device))
        self.num_batches += 1
        return x

    def reset(self) -> None:
        self.absmax = None
        self.num_batches = 0


def _observe_first_arg(obs: ActAbsMaxObserver):
    def hook(_module: nn.Module, args: tuple) -> None:
        obs(args[0])  # returning None keeps the module's inputs unchanged

    return hook


def collect_linear_act_absmax(model: nn.Module, run: Callable[[nn.Module], object],
                              include: Optional[Callable[[str, nn.Linear], bool]] = None
                              ) -> Dict[str, torch.Tensor]:
    """Run ``run(model)`` with an observer on the input of every ``nn.Linear`` (those ``include(path,
    module)`` accepts) and return ``{module path: absmax [in_features]}`` for those that were called.

    Observers sit in forward pre-hooks on the module *instances* and are removed afterwards, also on error.
    """
    observers: Dict[str, ActAbsMaxObserver] = {}
    handles = []
    try:
        for path, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and (include is None or include(path, mod)):
                obs = ActAbsMaxObserver()
                observers[path] = obs
                handles.append(mod.register_forward_pre_hook(_observe_first_arg(obs)))
        with torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return {p: o.absmax for p, o in observers.items() if o.absmax is not None}
