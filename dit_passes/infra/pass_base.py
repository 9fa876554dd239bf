"""The pass contract: what every graph pass in dit_passes states and returns.

Modelled on torch.fx's ``passes/infra`` (PassBase / PassResult), with the three things a DiT pass
must also say about itself:

* ``requires``   facts the graph must carry before the pass runs (e.g. ``"structure"``: block discovery
                 has annotated the graph). The PassManager checks them and names the missing one.
* ``provides``   facts the pass guarantees afterwards (e.g. ``"cache_branch"``).
* ``invalidates`` facts the rewrite makes stale (``"structure"`` when nodes of blocks were replaced);
                 the manager re-derives ``structure`` before the next pass that requires it.

``run`` mutates the GraphModule in place and returns a :class:`PassResult` with per-kind counts of what
was rewritten and a one-paragraph human report; a pass that changes nothing says so (``changed=False``).
Ordering constraints between passes are declared with ``run_after`` / ``run_before`` (pass names).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch.fx as fx


@dataclasses.dataclass
class PassResult:
    """What a pass did: ``counts`` (e.g. ``{"all_to_all": 16}``) and a short human report."""

    changed: bool
    counts: Dict[str, int] = dataclasses.field(default_factory=dict)
    report: str = ""

    def __str__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.counts.items()) or "nothing"
        return f"changed={self.changed} ({counts}) {self.report}".strip()


@dataclasses.dataclass
class PassContext:
    """Shared, per-compilation information handed to every pass.

    ``runtime`` is the object the compiled module exposes to the caller (cache state, collective
    groups, quantization tables): passes that need per-request state register it there instead of on a
    class or a global, so two compiled modules never share state.
    """

    example_inputs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    runtime: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # Which front end produced the graph: "export" (compile_dit) or "dynamo" (the torch.compile
    # backend). Passes that own parameters need to know whether weights are attributes or inputs.
    frontend: str = "export"


class PassError(RuntimeError):
    """A pass could not run, or left the graph broken. The message names the pass."""


class Pass:
    """Base class of every dit_passes graph pass. Subclasses set the class attributes and ``run``."""

    name: str = "pass"
    requires: Tuple[str, ...] = ()
    provides: Tuple[str, ...] = ()
    invalidates: Tuple[str, ...] = ()
    run_after: Tuple[str, ...] = ()
    run_before: Tuple[str, ...] = ()

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")

    def describe(self) -> str:
        """One line naming the pass and its configuration, used in reports and cache keys."""
        fields = getattr(self, "config_items", lambda: {})()
        args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{self.name}({args})"

    def __repr__(self) -> str:
        return self.describe()


def graph_facts(gm: fx.GraphModule) -> Dict[str, Any]:
    """The dict of facts passes record on a graph (``gm.meta["dit_passes"]``)."""
    return gm.meta.setdefault("dit_passes", {})


def get_fact(gm: fx.GraphModule, key: str, default: Optional[Any] = None) -> Any:
    return graph_facts(gm).get(key, default)
