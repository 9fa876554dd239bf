"""TaylorSeer calibrator as pure tensor functions (cache-dit 1.5.3's ``TaylorSeerState``, sync-free).

The ladder ``[Y, dY, d2Y, ...]`` (``order + 1`` tensors) is the last computed value of the cached quantity
and its finite differences. ``n_valid`` (an int64 0-dim tensor) says how many leading entries are defined;
the reference keeps ``None`` in the others.

Step numbering. The reference creates a stream's state lazily, at its first update, i.e. on the first
computed step of a generation (always step 0 of the cache context), with its own counter at -1; every later
call advances it. So the calibrator's step is ``context_step - 1``, and its rule "differences only when
``current_step > 1``" reads ``context_step >= 3`` here. Gaps (``window`` / ``elapsed``) are differences of
steps and do not depend on the frame. All functions take the context step.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

# Differences are formed only from the calibrator's step 2 on, which is context step 3 (see module doc).
FIRST_DIFFERENCE_STEP = 3


def empty_ladder(example: torch.Tensor, order: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """A ladder with nothing defined (the reference's fresh state), shaped like ``example``."""
    ladder = [torch.zeros_like(example) for _ in range(order + 1)]
    return ladder, torch.zeros((), dtype=torch.int64, device=example.device)


def taylor_update(ladder: Sequence[torch.Tensor], n_valid: torch.Tensor, y: torch.Tensor, step: torch.Tensor,
                  last_compute_step: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The ladder after a computed step with value ``y`` at context step ``step``.

    ``dY_{i+1} = (dY_i(new) - dY_i(old)) / window`` with ``window = step - last_compute_step``, formed while
    the old entry ``i`` is defined and ``step >= 3``. Unconditional: the caller keeps the old ladder on
    cached steps with ``torch.where``.
    """
    order = len(ladder) - 1
    window = step - last_compute_step
    new = [y]
    for i in range(order):
        # Undefined entries (old zeros) produce garbage here; n_valid masks them in taylor_predict.
        new.append((new[i] - ladder[i]) / window)
    # (a Python 0 in torch.where: no zeros tensor to allocate and fill on every call)
    allowed = torch.where(step >= FIRST_DIFFERENCE_STEP, torch.clamp(n_valid, max=order), 0)
    new_valid = 1 + allowed
    # Zero the undefined entries so no inf/nan from a zero window lingers in the state.
    new = [new[0]] + [torch.where(new_valid > i, d, 0.0) for i, d in enumerate(new[1:], start=1)]
    return new, new_valid


def taylor_predict(ladder: Sequence[torch.Tensor], n_valid: torch.Tensor, step: torch.Tensor,
                   last_compute_step: torch.Tensor) -> torch.Tensor:
    """``sum_i dY_i * elapsed**i / i!`` over the defined entries, ``elapsed = step - last_compute_step``.

    Same operation order as the reference (``(1/i!) * dY_i * elapsed**i``) so results agree bit for bit
    on the same device. Entries past ``n_valid`` are skipped: the reference stops at its first ``None``.
    """
    elapsed = step - last_compute_step
    out = ladder[0]  # entry 0 is defined once anything was computed (step 0 always computes)
    for i in range(1, len(ladder)):
        term = (1.0 / math.factorial(i)) * ladder[i] * (elapsed ** i)
        out = torch.where(n_valid > i, out + term, out)
    return out
