"""``Tensor.data`` while capture traces: read as ``detach()``, assignment refused (DESIGN.md section 1).

Why. ``x.data`` makes its tensor in C++ (a shallow copy, detached), outside the dispatcher that ``torch.export``
records: under tracing the result is a FakeTensor the graph does not know. Whatever the forward then does with it
is recorded against a *constant* holding that FakeTensor, and export fails at its end with "We found a fake tensor in
the exported program constant's list". Classes reach ``.data`` where they build a positional table at the input's
size, which they do only when that size differs from the config's sample size: CogVideoX's patch embedder (and
ConsisID's, the same class) writes its sincos table with ``joint.data[:, text:].copy_(table)``, so the model
captured at the sample size and failed at any other. A forward that reads a parameter through ``.data``
(``x @ self.weight.data``) failed the same way at every size.

What. While capture exports, :class:`TensorDataTraced` answers ``x.data`` with ``x.detach()``: the same storage
and values, no autograd history, and an op that export records (a view: a write through it reaches ``x``, as a
write through ``x.data`` does, once capture functionalises the graph). Capture runs the model under ``no_grad``,
where the two differ in nothing the graph can observe (``.data`` does not share ``x``'s version counter, which
only autograd reads). An assignment ``x.data = y`` swaps the tensor behind ``x`` in place, which no graph op
records: export would trace on with the old ``x`` and return a wrong result without an error. It raises
:class:`TensorDataAssignmentError` at the assignment instead, inside the submodule's forward, so that capture's
fallback runs that submodule eagerly (:mod:`dit_passes.capture_opaque`) or the capture fails naming the cause.

Graph before / after (CogVideoX's table at a size other than the sample size):
  before: export fails: ``lifted_tensor_0`` (the ``.data`` view) is a fake constant
  after:  ``new_zeros -> detach -> slice -> copy_(slice, table)``, functionalised by capture to
          ``slice_scatter(new_zeros, table, 1, text)``
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# the ``data`` attribute of every tensor: its getter and setter reach ``__torch_function__`` as the method-wrappers
# ``__get__`` / ``__set__`` bound to this descriptor (a new wrapper object per access, so compared by ``__self__``)
_DATA = torch._C.TensorBase.__dict__["data"]


class TensorDataAssignmentError(RuntimeError):
    """A traced forward assigned ``tensor.data = ...`` (not traceable; see the module docstring)."""


class TensorDataTraced(TorchFunctionMode):
    """Active around ``torch.export.export``: ``x.data`` -> ``x.detach()``; ``x.data = y`` raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _DATA:
            if func.__name__ == "__get__":
                return args[0].detach()
            raise TensorDataAssignmentError(
                "the forward assigns `tensor.data = ...`, which swaps the tensor behind a name where torch.export "
                "cannot see it (the graph would keep the old tensor). Assign the new tensor to the name instead "
                "(`x = y`), or write into it (`x.copy_(y)`)")
        return func(*args, **(kwargs or {}))
