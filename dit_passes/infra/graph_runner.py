"""GraphRunner: run an fx.GraphModule's graph eagerly with as little Python per node as possible.

Why: a lowered DiT graph has ~1,300 nodes for a 12-block model, and FX's generated ``forward`` pays for
each of them more than the eager model pays for the same op: every weight is an ``nn.Module.__getattr__``
chain (``getattr(self.transformer_blocks, "0").attn.to_q.weight``, ~1,200 per call), every op a lookup
of ``torch.ops.aten.<op>.<overload>`` then ``OpOverload.__call__``'s Python frame, and ``torch.cond`` the
higher-order-op dispatch. On the CPU, with small shapes, that is 10-15% of a call.

Contract: ``GraphRunner(gm)(*args)`` returns what ``gm(*args)`` returns (same ops, same order, same
values: the node targets are called, only the way they are reached changes). It generates, from the
graph, one Python function where

* a parameter / buffer is one dict lookup in its owner's ``_parameters`` / ``_buffers`` (so ``.to()``,
  ``load_state_dict`` and re-assigned buffers are seen; nothing is copied or cached);
* an ATen ``OpOverload`` is called through its C++ entry point (``op._op``, what ``__call__`` does);
* ``getitem`` is a subscript;
* ``torch.ops.higher_order.cond(pred, t, f, ops)`` stays the operator (dispatch modes see it: tests count
  the conditionals taken), its branches are GraphRunners;
* values are dropped after their last use, as FX's code does (same peak memory).

The runner regenerates itself when the graph module was recompiled since (a pass or a user edited the
graph). A module with forward hooks, or a graph whose placeholders take defaults, is run as ``gm(*args)``.
``gm`` itself (its graph, ``.code``, ``print_readable``) is untouched: printing and passes see FX.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, List

import torch
import torch.fx as fx

_COND = torch.ops.higher_order.cond


class GraphRunner:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self._fn: Callable[..., Any] = gm
        self._built_for: Any = None
        self._build()

    def __call__(self, *args: Any) -> Any:
        if type(self.gm).forward is not self._built_for:  # recompiled since: regenerate
            self._build()
        return self._fn(*args)

    @property
    def source(self) -> str:
        """The generated Python (for debugging); empty when the runner falls back to ``gm``."""
        return getattr(self, "_source", "")

    def _build(self) -> None:
        gm = self.gm
        self._built_for = type(gm).forward
        if gm._forward_hooks or gm._forward_pre_hooks or any(
                n.op == "placeholder" and n.args for n in gm.graph.nodes):
            self._fn, self._source = gm, ""
            return
        self._source, self._fn = _generate(gm)


def _owner_and_attr(gm: fx.GraphModule, target: str):
    owner_path, _, attr = target.rpartition(".")
    return (gm.get_submodule(owner_path) if owner_path else gm), attr


def _generate(gm: fx.GraphModule):
    env: Dict[str, Any] = {}          # globals of the generated function
    names: Dict[fx.Node, str] = {}
    bound: Dict[int, str] = {}        # id(object) -> its global name (one global per object)

    def bind(obj: Any, prefix: str) -> str:
        key = id(obj)
        if key not in bound:
            bound[key] = f"{prefix}{len(bound)}"
            env[bound[key]] = obj
        return bound[key]

    def fmt(a: Any) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, tuple):
            return "(" + "".join(fmt(x) + ", " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(fmt(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {fmt(v)}" for k, v in a.items()) + "}"
        if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        return bind(a, "_c")  # dtypes, devices, layouts, non-finite floats, ...

    def call_args(args, kwargs) -> str:
        parts = [fmt(a) for a in args] + [f"{k}={fmt(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    nodes = list(gm.graph.nodes)
    last_use: Dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for inp in n.all_input_nodes:
            last_use[inp] = n
    frees: Dict[fx.Node, List[str]] = {}

    params, body = [], []
    for i, n in enumerate(nodes):
        v = f"v{i}"
        names[n] = v
        if n.op == "placeholder":
            params.append(v)
            continue
        if n.op == "get_attr":
            owner, attr = _owner_and_attr(gm, n.target)
            if attr in owner._parameters:
                line = f"{v} = {bind(owner._parameters, '_d')}[{attr!r}]"
            elif attr in owner._buffers:
                line = f"{v} = {bind(owner._buffers, '_d')}[{attr!r}]"
            elif (attr in owner._modules and isinstance(owner._modules[attr], fx.GraphModule)
                  and n.users and all(u.target is _COND for u in n.users)):  # a cond branch
                line = f"{v} = {bind(GraphRunner(owner._modules[attr]), '_g')}"
            else:
                line = f"{v} = getattr({bind(owner, '_o')}, {attr!r})"
        elif n.op == "call_function":
            t = n.target
            if t is operator.getitem and not n.kwargs:
                line = f"{v} = {fmt(n.args[0])}[{fmt(n.args[1])}]"
            else:
                fn = t._op if type(t) is torch._ops.OpOverload else t
                line = f"{v} = {bind(fn, '_f')}({call_args(n.args, n.kwargs)})"
        elif n.op == "call_module":
            line = f"{v} = {bind(gm.get_submodule(n.target), '_m')}({call_args(n.args, n.kwargs)})"
        elif n.op == "call_method":
            line = f"{v} = {fmt(n.args[0])}.{n.target}({call_args(n.args[1:], n.kwargs)})"
        elif n.op == "output":
            body.append(f"return {fmt(n.args[0])}")
            break
        else:
            raise NotImplementedError(f"GraphRunner: node op {n.op!r}")
        body.append(line)
        dead = [names[inp] for inp in n.all_input_nodes if last_use.get(inp) is n]
        if not n.users:
            dead.append(v)
        if dead:
            body.append("del " + ", ".join(dict.fromkeys(dead)))
    src = f"def run({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
    code = compile(src, f"<dit_passes.GraphRunner {type(gm).__name__}>", "exec")
    exec(code, env)  # noqa: S102 - our own generated source, from the graph's nodes only
    return src, env["run"]


__all__ = ["GraphRunner"]
