"""Offload: the bytes resident on the onload device stay within the configured bound, measured at run
time rather than read from the graph: a dispatch mode records every tensor ``dit_passes::onload`` returns (weak
references only) and, at each load, sums the bytes of the onloaded copies still alive. The peak must stay within
the configured bound (sync: one block; async with 2 ahead: three blocks and more than one; byte cap; persistent)."""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build

ONLOAD = torch.ops.dit_passes.onload.default


class _AliveOnloaded(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs, self.peak, self.loads = [], 0, 0

    def _alive(self):
        return sum(n for r, n in self.refs if r() is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is ONLOAD:
            self.loads += 1
            for t in out:
                self.refs.append((weakref.ref(t), t.numel() * t.element_size()))
            self.peak = max(self.peak, self._alive())
        return out


def _block_bytes(model, structure):
    return [sum(t.numel() * t.element_size() for t in model.get_submodule(b.path).parameters())
            for b in structure.blocks]


def _run(model, kw, **opts):
    c = compile_dit(model, passes=[passes.LayerwiseOffload(onload_device="cpu", **opts)], example_inputs=kw)
    mode = _AliveOnloaded()
    gc.collect()
    with torch.no_grad(), mode:
        out = c(**kw)[0]
    return c, mode, out


def test_runtime_resident_onloaded_bytes_within_configured_bound():
    zm = build("flux")
    kw = zm.make_inputs()
    with torch.no_grad():
        ref = zm.model(**kw)[0]

    c, mode, out = _run(zm.model, kw)  # synchronous: one block's weights at a time
    sizes = _block_bytes(zm.model, c.structure)
    assert torch.equal(out, ref)
    assert mode.loads == 4 and 0 < mode.peak <= max(sizes), (mode.peak, sizes)

    c, mode, out = _run(zm.model, kw, async_transfer=True, transfer_buckets=2)  # running block + 2 ahead
    assert torch.equal(out, ref)
    assert mode.loads == 4 and max(sizes) < mode.peak <= sum(sorted(sizes)[-3:]), (mode.peak, sizes)

    one = max(sizes)  # byte budget for what is loaded ahead
    c, mode, out = _run(zm.model, kw, async_transfer=True, transfer_buckets=2, max_inflight_prefetch_bytes=one)
    assert torch.equal(out, ref)
    assert mode.peak <= 2 * one, (mode.peak, one)

    c, mode, out = _run(zm.model, kw, persistent_buckets=2, persistent_bins=2)  # blocks 0 and 2 stay
    assert torch.equal(out, ref)
    assert mode.loads == 2 and mode.peak <= max(sizes[1], sizes[3])
