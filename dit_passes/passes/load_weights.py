"""LoadWeights: read the weights of a model built on the meta device from its checkpoint.

``compile_dit(model, passes, weights=<safetensors>)`` adds this pass itself; it is not meant for ``passes=[...]``.

Contract: phase ``LOAD_WEIGHTS`` (after ``QUANTIZE``, before ``OFFLOAD`` and anything that computes from a
weight); reads and writes no fact. Requires: the graph's attributes that stand for checkpoint tensors are stand-ins of
:mod:`dit_passes.infra.weight_source` (one element broadcast to the full shape), the checkpoint in
``ctx.runtime.weights.source``. The passes before have replaced what they keep in another form, reading it from
the source themselves (tensor parallelism its rank's slice, quantization one weight at a time); every stand-in left
is read whole, as the stand-in's dtype on its device. Guarantees: no graph attribute
is a stand-in afterwards; ``into[target]`` is each tensor read (the compiled module puts it in the model's slot,
so the model and the graph share it). Refuses a checkpoint lacking a name or holding another shape, naming both.

Before / after (the graph code is unchanged; its attribute is)::

    transformer_blocks.0.norm1.linear.weight: stand-in f32[384, 64] (stride (0, 0), no storage)
    transformer_blocks.0.norm1.linear.weight: f32[384, 64] read from the checkpoint

Counts: ``loaded`` (tensors), ``bytes`` (as read from the files).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.fx as fx

from ..infra.pass_base import Pass, PassContext, PassResult
from ..infra.phases import Phase
from ..infra.weight_source import check_shape, source_name


class LoadWeights(Pass):
    name = "load_weights"
    phase = Phase.LOAD_WEIGHTS

    def __init__(self, into: Dict[str, torch.Tensor]):
        self.into = into  # target -> the tensor read (the compiled module's, for the model's slots)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        source = ctx.runtime.weights.source
        nodes: Dict[str, list] = {}
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                nodes.setdefault(n.target, []).append(n)
        loaded = nbytes = 0
        for target, readers in nodes.items():
            *parents, leaf = target.split(".")
            owner = gm.get_submodule(".".join(parents))
            t = getattr(owner, leaf)
            name = source_name(t)
            if name is None:
                continue
            check_shape(source, name, t.shape, f"load_weights (module {'.'.join(parents) or '<root>'}, {leaf})")
            before = source.bytes_read.get(name, 0)
            value = source.read(name, dtype=t.dtype, device=t.device)
            nbytes += source.bytes_read[name] - before
            if leaf in owner._parameters:
                value = torch.nn.Parameter(value, requires_grad=False)
                owner._parameters[leaf] = value
            else:
                owner._buffers[leaf] = value
            self.into[target] = value
            loaded += 1
            fake = readers[0].meta["val"].fake_mode.from_tensor(value, static_shapes=True)
            for n in readers:
                n.meta["val"] = fake
        report = f"read {loaded} weight(s) whole from {source} ({nbytes} bytes)" if loaded else \
            "no weight left on the meta device"
        return PassResult(loaded > 0, {"loaded": loaded, "bytes": nbytes}, report)
