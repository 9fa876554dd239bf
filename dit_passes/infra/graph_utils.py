"""Small graph helpers shared by the passes: shape metadata for new nodes, liveness across a cut,
and extraction of a node range into its own GraphModule (a branch of torch.cond, a segment)."""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def fake_of(x: Any) -> Any:
    """The FakeTensor (or constant) standing for an argument: node -> meta['val']; a ``get_attr`` of a
    submodule (a higher-order op's body graph), which has no value, -> the submodule itself."""
    if isinstance(x, fx.Node):
        if x.op == "get_attr" and "val" not in x.meta and x.graph.owning_module is not None:
            return operator.attrgetter(x.target)(x.graph.owning_module)
        return x.meta["val"]
    return x


def set_val(node: fx.Node, fn: Callable[..., Any] | None = None) -> fx.Node:
    """Compute ``meta['val']`` of a new call_function node by running its target on the fake inputs.

    The fake mode is the one of its inputs (export's), so shapes stay consistent with the graph.
    """
    from torch._guards import detect_fake_mode

    fn = fn or node.target
    args, kwargs = pytree.tree_map(fake_of, (node.args, node.kwargs))
    vals = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(vals)
    if mode is None:
        raise ValueError(f"cannot propagate shapes for {node.format_node()}: its inputs carry no fake values")
    with mode:
        node.meta["val"] = fn(*args, **kwargs)
    return node


def copy_meta(dst: fx.Node, src: fx.Node, keys: Sequence[str] = ("nn_module_stack", "dit_module_path", "stack_trace")) -> None:
    for k in keys:
        if k in src.meta:
            dst.meta[k] = src.meta[k]


def node_index(gm: fx.GraphModule) -> Dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def live_across(nodes_before: Iterable[fx.Node], nodes_after: Set[fx.Node]) -> List[fx.Node]:
    """Values defined in ``nodes_before`` (in order) that a node in ``nodes_after`` uses."""
    out = []
    for n in nodes_before:
        if n.op in ("get_attr", "output"):
            continue
        if any(u in nodes_after for u in n.users):
            out.append(n)
    return out


def extract_subgraph(gm: fx.GraphModule, nodes: Sequence[fx.Node], inputs: Sequence[fx.Node],
                     outputs: Sequence[fx.Node], name: str = "segment") -> fx.GraphModule:
    """Copy ``nodes`` (graph order) into a new GraphModule taking ``inputs`` and returning ``outputs``.

    Parameters the nodes read through ``get_attr`` are shared with ``gm`` (same tensor objects), under
    the same attribute paths. The original graph is not modified.
    """
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        ph = g.placeholder(inp.name)
        ph.meta = dict(inp.meta)
        env[inp] = ph
    root = torch.nn.Module()
    node_set = set(nodes)

    def lookup(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr":
            _share_attr(gm, root, a.target)
            new = g.get_attr(a.target)
            new.meta = dict(a.meta)
            env[a] = new
            return new
        raise ValueError(f"{name}: node '{a.name}' used by the segment is neither an input nor inside it")

    for n in nodes:
        if n.op == "get_attr":
            lookup(n)
            continue
        new = g.node_copy(n, lookup)
        env[n] = new
        assert n in node_set
    g.output(tuple(env[o] for o in outputs))
    sub = fx.GraphModule(root, g, class_name=name)
    return sub


def _share_attr(src: fx.GraphModule, dst: torch.nn.Module, target: str) -> None:
    """Make ``dst.<target>`` the very tensor/module ``src.<target>`` is (creating parent modules)."""
    *path, leaf = target.split(".")
    s, d = src, dst
    for p in path:
        s = getattr(s, p)
        if not hasattr(d, p):
            d.add_module(p, torch.nn.Module())
        d = getattr(d, p)
    val = getattr(s, leaf)
    if isinstance(val, torch.nn.Parameter):
        d.register_parameter(leaf, val)
    elif isinstance(val, torch.Tensor):
        d.register_buffer(leaf, val, persistent=leaf in getattr(s, "_buffers", {}) and leaf not in s._non_persistent_buffers_set)
    else:
        setattr(d, leaf, val)


def erase_unused(gm: fx.GraphModule) -> int:
    """Dead-code elimination that keeps in-place ops and collectives (impure nodes)."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    return before - len(gm.graph.nodes)


def replace_uses_after(old: fx.Node, new: fx.Node, after: Optional[fx.Node] = None) -> None:
    old.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and u is not after)
