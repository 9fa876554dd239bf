"""The pass contract: what every graph pass in dit_passes states and returns.

Modelled on torch.fx's ``passes/infra`` (PassBase / PassResult), with what a DiT pass must also say
about itself:

* ``phase``       where it runs (:class:`~dit_passes.infra.phases.Phase`); the PassManager orders by phase.
* ``reads``       the graph facts (fields of :class:`~dit_passes.infra.facts.GraphFacts`) it reads; a derived
                  one (``"structure"``) is re-discovered when the pass first reads it while it is missing.
* ``writes``      the facts it may assign or extend.
* ``invalidates`` derived facts the rewrite makes stale (``"structure"`` when nodes of blocks were
                  replaced); they are dropped after the pass and re-derived for the next reader.

``run`` mutates the GraphModule in place and returns a :class:`PassResult` with per-kind counts of what
was rewritten and a one-paragraph human report; a pass that changes nothing says so (``changed=False``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch.fx as fx

from .facts import check_fact_names
from .phases import Phase
from .runtime import Runtime


@dataclasses.dataclass
class PassResult:
    """What a pass did: ``counts`` (e.g. ``{"all_to_all": 16}``) and a short human report."""

    changed: bool
    counts: Dict[str, int] = dataclasses.field(default_factory=dict)
    report: str = ""

    def __str__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.counts.items()) or "nothing"
        return f"changed={self.changed} ({counts}) {self.report}".strip()


def skipped_summary(skipped: Dict[str, int], heading: str) -> Tuple[Dict[str, int], str]:
    """What a pass left, by reason (``{"no_bias": 2}``): ``{"skipped_no_bias": 2}`` for its counts and
    ``"; <heading>: 2 no bias"`` for its report (empty when nothing was left), reasons sorted."""
    items = sorted(skipped.items())
    text = f"; {heading}: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in items) if items else ""
    return {f"skipped_{k}": v for k, v in items}, text


@dataclasses.dataclass
class PassContext:
    """Shared, per-compilation information handed to every pass.

    ``runtime`` is the object the compiled module exposes to the caller: passes that need per-request
    state keep it in ``runtime.state[<pass name>]`` and their reports in ``runtime.register_report``,
    never on a class or a global, so two compiled modules never share state. ``graph_id`` numbers the
    module's lowered graphs (one per input signature).
    """

    example_inputs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    runtime: Runtime = dataclasses.field(default_factory=Runtime)
    graph_id: int = 0
    # Which front end produced the graph: "export" (compile_dit) or "dynamo" (the torch.compile
    # backend). Passes that own parameters need to know whether weights are attributes or inputs.
    frontend: str = "export"
    # The graph module whose closing recompile the running PassManager takes over (see recompile_at_end), and
    # whether the pass asked for it; set and reset by the manager around each pass.
    _deferred_gm: Optional[fx.GraphModule] = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _recompile_asked: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def recompile_at_end(self, gm: fx.GraphModule) -> None:
        """``gm.recompile()`` as a pass's last step (nothing may read ``gm``'s code or call it after this).

        Run by a :class:`~dit_passes.infra.pass_manager.PassManager`, the recompile is done once by the manager
        right after ``run`` returns (a failure is still the pass's crash), and the manager's verification lints
        that code instead of generating it again: FX codegen + ``compile`` of a 6000-node FLUX graph is ~0.2 s,
        before this twice per pass. Outside a manager (a pass run directly), it recompiles now."""
        if gm is self._deferred_gm:
            self._recompile_asked = True
        else:
            gm.recompile()


class Refusal(Exception):
    """Marks an error type that refuses a rewrite before it runs (a sharding, mesh, block-discovery or capture
    error the pass relies on): a pass that raises one refused; anything else a pass raises while rewriting is
    a crash (:class:`PassCrashed`)."""


class PassError(RuntimeError, Refusal):
    """A pass could not run, or left the graph broken. The message names the pass."""


class PassCrashed(PassError):
    """A pass raised something other than a refusal while it rewrote the graph (the cause is chained): not a
    refusal decided before the rewrite but a defect of the pass. A PassError, so callers that catch those still
    do; ``dit-passes coverage`` counts it as an error."""


class Pass:
    """Base class of every dit_passes graph pass. Subclasses set the class attributes and ``run``."""

    name: str = "pass"
    phase: Optional[Phase] = None
    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    invalidates: Tuple[str, ...] = ()
    # weight targets the pass replaces from stored values without reading the old ones (LoadQuantized): lowering
    # may then stand in for them where another compiled module released them
    loads_weights: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for kind in ("reads", "writes", "invalidates"):
            check_fact_names(cls.__name__, kind, getattr(cls, kind))
        if cls.phase is not None and not isinstance(cls.phase, Phase):
            raise TypeError(f"{cls.__name__}.phase must be a dit_passes.infra.phases.Phase, got {cls.phase!r}")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")

    def describe(self) -> str:
        """One line naming the pass and its configuration, used in reports and cache keys."""
        fields = getattr(self, "config_items", lambda: {})()
        args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{self.name}({args})"

    def __repr__(self) -> str:
        return self.describe()
