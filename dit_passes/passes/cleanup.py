"""Cleanup: remove the bookkeeping nodes torch.export leaves, so printed graphs read like the model.

Requires: a captured graph. Guarantees: same function; no ``aten._assert_tensor_metadata`` nodes, no
``aten.to`` / ``aten._to_copy`` whose output equals its input (same dtype, device and layout), and no
dead nodes.

Before::

    _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(x, dtype=torch.float32, ...)
    to_3 = torch.ops.aten.to.dtype(x, torch.float32)
    linear = torch.ops.aten.linear.default(to_3, w, b)

After::

    linear = torch.ops.aten.linear.default(x, w, b)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..infra.pass_base import Pass, PassContext, PassResult
from ..infra.phases import Phase

aten = torch.ops.aten
_TO_OPS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.alias.default}


def _is_noop_to(n: fx.Node) -> bool:
    if n.target not in _TO_OPS or not isinstance(n.args[0], fx.Node):
        return False
    src, out = n.args[0].meta.get("val"), n.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if n.kwargs.get("copy") or (len(n.args) > 3 and n.args[3] is True):
        return False
    return (src.dtype == out.dtype and src.device == out.device and src.shape == out.shape
            and src.stride() == out.stride())


class Cleanup(Pass):
    name = "cleanup"
    phase = Phase.CLEANUP
    invalidates = ("structure",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        asserts = noop_to = 0
        for n in list(gm.graph.nodes):
            if n.op != "call_function":
                continue
            if n.target is aten._assert_tensor_metadata.default or n.target is aten._assert_scalar.default:
                if not n.users:
                    gm.graph.erase_node(n)
                    asserts += 1
            elif _is_noop_to(n):
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
                noop_to += 1
        dead = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        dead -= len(gm.graph.nodes)
        ctx.recompile_at_end(gm)
        counts = {"assert_removed": asserts, "noop_to_removed": noop_to, "dead_removed": dead}
        return PassResult(bool(asserts or noop_to or dead), counts,
                          f"removed {asserts} metadata asserts, {noop_to} no-op casts, {dead} dead nodes")
