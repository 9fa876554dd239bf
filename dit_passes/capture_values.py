"""Value specialisation for capture (``capture.py``): the eager run records every Python scalar the model reads from
a tensor and every data-dependent length; tracing replays them, keeping the traced tensors as the guard.

Recorded (:class:`ScalarRecorder`, in call order): ``item`` / ``tolist`` / ``bool`` / ``int`` / ``float`` reads,
tensor slice bounds (``x[:, :n]``), one-element integer tensors passed as sizes (``reshape(b, gh, gw, ...)``), the
lengths of ``nonzero``, boolean-mask indexing and ``repeat_interleave`` with tensor repeats. Replayed
(:class:`ScalarReplay`): each read answers the eager value; ``nonzero`` becomes ``nonzero_static`` of the eager
length, ``repeat_interleave`` gets the eager ``output_size``; ``sources`` are the traced tensors each value came
from (capture stacks them into the guard output).
"""
from __future__ import annotations

from typing import Any, List, Sequence

import torch
from torch.overrides import TorchFunctionMode


def _flat_values(x: Any) -> List[Any]:
    return [v for item in x for v in _flat_values(item)] if isinstance(x, list) else [x]


_NONZERO = (torch.nonzero, torch.Tensor.nonzero)
# Python scalars read from a tensor: ``item()``, ``bool(t)``, ``int(t)`` (QwenImage 2.1's prefix length) ...
_SCALAR_READS = (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
                 torch.Tensor.__float__)
_REPEAT_INTERLEAVE = (torch.repeat_interleave, torch.Tensor.repeat_interleave)


def _nonzero_call(func, args, kwargs) -> str | None:
    """``"index"`` for ``nonzero(x)`` (one index tensor), ``"tuple"`` for ``nonzero(x, as_tuple=True)`` (one per
    dim), None for any other call: the number of non-zeros is a data-dependent length."""
    if func not in _NONZERO:
        return None
    as_tuple = (kwargs or {}).get("as_tuple", args[1] if len(args) > 1 and isinstance(args[1], bool) else False)
    return "tuple" if as_tuple else "index"


def _repeat_interleave_length(func, args, kwargs) -> torch.Tensor | None:
    """For ``repeat_interleave`` with tensor repeats and no ``output_size``: its output length along the repeated
    dim, as a tensor (a data-dependent size); None for any other call."""
    kwargs = kwargs or {}
    if func not in _REPEAT_INTERLEAVE or kwargs.get("output_size") is not None:
        return None
    if len(args) == 1 and "repeats" not in kwargs:  # repeat_interleave(repeats): the repeated indices
        return args[0].sum() if isinstance(args[0], torch.Tensor) else None
    x, repeats = args[0], (args[1] if len(args) > 1 else kwargs.get("repeats"))
    if not isinstance(repeats, torch.Tensor):
        return None
    dim = _repeat_interleave_dim(args, kwargs)
    if repeats.numel() == 1:  # one count for every element
        return repeats.reshape(()) * (x.numel() if dim is None else x.shape[dim])
    return repeats.sum()


def _scalar_source(func, x: torch.Tensor) -> torch.Tensor:
    """The tensor whose value equals the scalar that ``func`` reads from ``x`` (the guard compares the two)."""
    if func is torch.Tensor.__bool__:
        return x != 0
    if func in (torch.Tensor.__int__, torch.Tensor.__index__) and x.is_floating_point():
        return x.trunc()
    return x


def _repeat_interleave_dim(args, kwargs) -> int | None:
    return args[2] if len(args) > 2 else (kwargs or {}).get("dim")


def _bool_mask_index(func, args) -> tuple | None:
    """``(index tuple, position of its boolean mask)`` for ``x[..., mask, ...]`` (a data-dependent number of rows),
    else None."""
    if func is not torch.Tensor.__getitem__ or len(args) < 2:
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    masks = [i for i, x in enumerate(index) if isinstance(x, torch.Tensor) and x.dtype == torch.bool]
    return (index, masks[0]) if len(masks) == 1 else None


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _tensor_slice_bounds(func, args) -> List[torch.Tensor]:
    """The tensor bounds of the slices in ``x[..., :n, ...]`` (read or written; HunyuanVideo-Framepack cuts its
    text to ``mask.sum()`` tokens this way): each is a data-dependent size, read in C++ without ``item()``."""
    if func not in _INDEXING or len(args) < 2:
        return []
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return [b for s in index if isinstance(s, slice) for b in (s.start, s.stop, s.step) if isinstance(b, torch.Tensor)]


def _with_int_bounds(args: tuple, value_of) -> tuple:
    """``args`` of an indexing call with each tensor slice bound replaced by ``value_of(bound)``."""
    def fix(b):
        return value_of(b) if isinstance(b, torch.Tensor) else b

    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    index = tuple(slice(fix(s.start), fix(s.stop), fix(s.step)) if isinstance(s, slice) else s for s in index)
    return (args[0], index if isinstance(args[1], tuple) else index[0], *args[2:])


# calls that take sizes: a one-element integer tensor there is read as a Python int in C++ (HiDream reshapes its
# output with the patch grid it keeps in a tensor), which export can only trace as an unbacked size
_SIZE_CALLS = (torch.Tensor.reshape, torch.Tensor.view, torch.reshape, torch.Tensor.expand, torch.Tensor.repeat,
               torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty)


def _with_int_sizes(func, args: tuple, value_of) -> tuple | None:
    """``args`` of a size-taking call with each one-element integer tensor among its sizes replaced by
    ``value_of(tensor)``; None when it has none."""
    if func not in _SIZE_CALLS or len(args) < 2:
        return None
    found = False

    def fix(x):
        nonlocal found
        if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() and not x.is_complex() \
                and x.dtype is not torch.bool:
            found = True
            return value_of(x)
        return x

    sizes = tuple(type(a)(fix(x) for x in a) if isinstance(a, (tuple, list)) else fix(a) for a in args[1:])
    return (args[0], *sizes) if found else None


class ScalarRecorder(TorchFunctionMode):
    """Eager run: records, in call order, every Python scalar read from a tensor (item / tolist / bool / int, tensor
    slice bounds) and every data-dependent length (``nonzero``, boolean-mask indexing, ``repeat_interleave`` with
    tensor repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: List[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.values.extend(int(b) for b in _tensor_slice_bounds(func, args))  # replayed before a mask count
        _with_int_sizes(func, args, lambda size: self.values.append(int(size)))
        if func in _SCALAR_READS:
            self.values.append(out)
        elif func is torch.Tensor.tolist:
            self.values.extend(_flat_values(out))  # FakeTensor.tolist reads them one item() each
        elif (kind := _nonzero_call(func, args, kwargs)) is not None:
            self.values.append(int((out[0] if kind == "tuple" else out).shape[0]))
        elif _repeat_interleave_length(func, args, kwargs) is not None:
            dim = _repeat_interleave_dim(args, kwargs)
            self.values.append(int(out.shape[0 if dim is None else dim]))
        elif (masked := _bool_mask_index(func, args)) is not None:
            index, at = masked
            self.values.append(int(index[at].sum()))
        return out


class ScalarReplay(TorchFunctionMode):
    """Tracing: answers each scalar read and tensor slice bound with the eager value, keeping the traced tensor as a
    guard; a ``nonzero`` becomes ``nonzero_static`` of the eager length, guarded by the count of non-zeros, a
    ``repeat_interleave`` gets the eager ``output_size``, guarded by the sum of its repeats."""

    def __init__(self, values: Sequence[Any]) -> None:
        super().__init__()
        self.values = list(values)
        self.sources: List[torch.Tensor] = []

    def _next(self, source: torch.Tensor) -> Any:
        if len(self.sources) >= len(self.values):
            from .capture import CaptureError
            raise CaptureError("the traced model reads more tensor scalars than its eager run did")
        self.sources.append(source)
        return self.values[len(self.sources) - 1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SCALAR_READS:
            return self._next(_scalar_source(func, args[0]))
        if _tensor_slice_bounds(func, args):  # x[:, :n] with a traced n: slice at the eager value
            args = _with_int_bounds(args, lambda bound: int(self._next(bound)))
        args = _with_int_sizes(func, args, lambda size: int(self._next(size))) or args
        kind = _nonzero_call(func, args, kwargs)
        if kind is not None:
            x = args[0]
            rows = torch.nonzero_static(x, size=int(self._next((x != 0).sum())))
            return tuple(rows.unbind(1)) if kind == "tuple" else rows
        length = _repeat_interleave_length(func, args, kwargs)
        if length is not None:  # the eager length, guarded by the sum of the repeats
            return func(*args, **{**(kwargs or {}), "output_size": int(self._next(length))})
        masked = _bool_mask_index(func, args)
        if masked is not None:  # x[mask] == x[rows of nonzero(mask)], with the eager count of rows
            index, at = masked
            mask = index[at]
            rows = torch.nonzero_static(mask, size=int(self._next(mask.sum()))).unbind(1)
            return args[0][index[:at] + tuple(rows) + index[at + 1:]]
        return func(*args, **(kwargs or {}))
