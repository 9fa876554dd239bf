"""Quantized-linear substitution: the ``aten.linear`` pattern and its quantized replacements.

Written in the style of Inductor's pattern matcher (plain functions whose traced graphs are the
pattern and the replacement). A replacement takes the pattern's ``x`` plus the quantized tensors, in
the order of ``QUANT_KINDS[kind].tensor_args``; :func:`replace_linear_node` performs the substitution
on an exported graph (registering the tensors as buffers reached by ``get_attr``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx

import dit_passes.quant.custom_ops  # noqa: F401  (registers torch.ops.dit_passes.*)


def linear_pattern(x, weight, bias):
    return torch.ops.aten.linear.default(x, weight, bias)


def linear_pattern_no_bias(x, weight):
    return torch.ops.aten.linear.default(x, weight)


def svdq_w4a4_replacement(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_w4a4_linear.default(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


def fp8_per_row_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.fp8_linear.default(x, qweight, wscale, bias, "per_row")


def fp8_per_tensor_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.fp8_linear.default(x, qweight, wscale, bias, "per_tensor")


def int8_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.int8_linear.default(x, qweight, wscale, bias)


@dataclass(frozen=True)
class QuantKind:
    """How to call one quantized op: the replacement and the names of its tensor arguments after x
    (the keys of the prepared weight's ``tensors()``; ``bias`` may be absent)."""

    replacement: Callable
    op: torch._ops.OpOverload
    tensor_args: Tuple[str, ...]
    const_args: Tuple[str, ...] = ()


_8BIT_ARGS = ("qweight", "wscale", "bias")
QUANT_KINDS: Dict[str, QuantKind] = {
    "svdq_w4a4": QuantKind(svdq_w4a4_replacement, torch.ops.dit_passes.svdq_w4a4_linear.default,
                           ("qweight", "wscale", "lora_down", "lora_up", "smooth_inv", "bias")),
    "fp8_per_row": QuantKind(fp8_per_row_replacement, torch.ops.dit_passes.fp8_linear.default, _8BIT_ARGS,
                             ("per_row",)),
    "fp8_per_tensor": QuantKind(fp8_per_tensor_replacement, torch.ops.dit_passes.fp8_linear.default, _8BIT_ARGS,
                                ("per_tensor",)),
    "int8_per_row": QuantKind(int8_replacement, torch.ops.dit_passes.int8_linear.default, _8BIT_ARGS),
}


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.aten.linear.default, torch.nn.functional.linear)


def replace_linear_node(gm: fx.GraphModule, node: fx.Node, kind: str, tensors: Dict[str, torch.Tensor],
                        attr_prefix: str) -> fx.Node:
    """Replace the ``aten.linear`` ``node`` of ``gm`` by the quantized op ``kind`` on ``tensors``.

    The tensors become buffers ``<attr_prefix>.<name>`` of ``gm`` (e.g. ``transformer_blocks.0.attn.to_q.
    qweight``); the new node copies the old node's metadata and gets ``meta["val"]`` from the op's fake
    implementation when the graph carries fake values. The original weight stays an attribute: remove
    it (and dead get_attr nodes) afterwards to free memory. Returns the new node.
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"unknown quantized linear kind {kind!r}; one of {sorted(QUANT_KINDS)}")
    if not _is_linear(node):
        raise ValueError(f"{node.format_node()} is not an aten.linear node")
    spec = QUANT_KINDS[kind]
    missing = [a for a in spec.tensor_args if a != "bias" and a not in tensors]
    if missing:
        raise KeyError(f"{kind} needs tensors {missing}; got {sorted(tensors)}")
    x = node.args[0]
    with gm.graph.inserting_before(node):
        args = [x]
        for name in spec.tensor_args:
            t: Optional[torch.Tensor] = tensors.get(name)
            if t is None:
                args.append(None)
                continue
            target = f"{attr_prefix}.{name}"
            _register_buffer(gm, target, t)
            get = gm.graph.get_attr(target)
            if "val" in node.meta:
                get.meta["val"] = _fake_like(node, t)
            args.append(get)
        # The replacement function is a single op call: insert that call directly.
        new = gm.graph.call_function(spec.op, tuple(args) + spec.const_args)
    for k in ("nn_module_stack", "dit_module_path", "stack_trace"):
        if k in node.meta:
            new.meta[k] = node.meta[k]
    if "val" in node.meta:
        from dit_passes.infra.graph_utils import set_val

        set_val(new)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _register_buffer(gm: fx.GraphModule, target: str, t: torch.Tensor) -> None:
    *parents, leaf = target.split(".")
    mod = gm
    for p in parents:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if hasattr(mod, leaf) and leaf not in mod._buffers:
        raise ValueError(f"{target} already exists on the graph module and is not a buffer")
    mod.register_buffer(leaf, t)


def _fake_like(node: fx.Node, t: torch.Tensor):
    """A fake tensor for ``t`` in the fake mode of the graph's values."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([node.meta["val"]])
    return mode.from_tensor(t, static_shapes=True) if mode is not None else t
