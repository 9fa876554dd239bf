"""dit_passes as a torch.compile backend, and as an Inductor post-grad custom pass.

``torch.compile(model, backend=dit_passes.backend(passes=[...]))``: Dynamo captures the model, a
pre-dispatch trace lowers it to ATen (the level torch.export produces, so ``aten.linear`` and attention
stay whole and block discovery finds the same structure as ``compile_dit``), our passes run on that graph, and the result goes
to Inductor (``compiler="inductor"``) or runs as is (``compiler="eager"``, for CPU tests).

Difference from ``compile_dit``: Dynamo passes parameters as graph inputs, so passes that replace
weights (sharding, quantization) need ``compile_dit``; analysis and the cache passes work in both.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from .capture import annotate_module_paths
from .infra.pass_base import Pass, PassContext
from .infra.pass_manager import PassManager
from .passes.cleanup import Cleanup


class DitBackend:
    """A torch.compile backend; ``last_manager`` keeps the last graph's pass records for inspection."""

    def __init__(self, passes: Sequence[Pass] = (), compiler: str = "inductor", dump_dir: Optional[str] = None):
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"compiler must be 'inductor' or 'eager', got {compiler!r}")
        self.passes = list(passes)
        PassManager(self.passes)  # validate now
        self.compiler = compiler
        self.dump_dir = dump_dir
        self.graphs: List[fx.GraphModule] = []
        self.last_manager: Optional[PassManager] = None

    def _fw_compiler(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable:
        annotate_module_paths(gm)
        manager = PassManager([Cleanup(), *self.passes], dump_dir=self.dump_dir)
        manager.run(gm, PassContext(example_inputs={"args": example_inputs}, frontend="dynamo"))
        self.last_manager = manager
        self.graphs.append(gm)
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable:
        return self._fw_compiler(lower_to_aten(gm, example_inputs), example_inputs)

    @property
    def structure(self):
        from .analysis.blocks import get_structure
        if not self.graphs:
            raise RuntimeError("the backend has compiled no graph yet: run the compiled model once")
        return get_structure(self.graphs[-1])


def lower_to_aten(gm: fx.GraphModule, example_inputs: List[Any]) -> fx.GraphModule:
    """Dynamo graph -> ATen graph at export's level (pre-dispatch: ``aten.linear`` and
    ``aten.scaled_dot_product_attention`` stay whole), keeping each node's ``nn_module_stack``."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Trace in Dynamo's own fake mode (its shape env), so no guard is created on unknown symbols.
    mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fx_traceback.preserve_node_meta(), torch.no_grad(), mode:
        aten_gm = make_fx(run, pre_dispatch=True, tracing_mode="real")(*fakes)
    return aten_gm


def backend(passes: Sequence[Pass] = (), compiler: str = "inductor", dump_dir: Optional[str] = None) -> DitBackend:
    return DitBackend(passes, compiler, dump_dir)


def _pass_uuid(passes: Sequence[Pass]) -> str:
    desc = "|".join(p.describe() for p in passes)
    return hashlib.sha256(desc.encode()).hexdigest()


try:  # torch >= 2.6
    from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass
except Exception:  # noqa: BLE001
    _CustomGraphPass = object  # type: ignore[assignment,misc]


class InductorPostGradPass(_CustomGraphPass):  # type: ignore[misc,valid-type]
    """Our pass pipeline as ``torch._inductor.config.post_grad_custom_post_pass``.

    ``uuid()`` is a hash of the passes' descriptions, so Inductor's FX-graph cache keys on the pipeline.
    Post-grad graphs are decomposed (``mm`` instead of ``linear``): use passes that only need block
    structure here (e.g. analysis); weight-rewriting passes belong in ``compile_dit``.
    """

    def __init__(self, passes: Sequence[Pass] = ()):
        self.passes = list(passes)
        self.last_manager: Optional[PassManager] = None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("post-grad graph has no owning module")
        annotate_module_paths(gm)
        manager = PassManager(self.passes, verify=False)
        manager.run(gm, PassContext(frontend="inductor"))
        self.last_manager = manager

    def uuid(self) -> str:
        return _pass_uuid(self.passes)
