"""Context (sequence) parallelism as graph rewrites: ``Ulysses(size)``, ``Ring(size)``, ``USP(ulysses, ring)``.

Contract: phase ``SHARD_SEQUENCE``; reads ``structure`` and invalidates it; writes the facts
``parallel_group`` (the ranks that share the sequence: the residual cache all-reduces over it) and
``mesh``. Every rank passes the full inputs and gets the full output; the graph is specialised to
this rank; ``size=1`` is a no-op that says so. The rules (which values carry the token dim, no
per-model plan) are :mod:`dit_passes.parallel.sequence_sharding`. Zoo Flux (16 image + 8 text
tokens), before::

    cat_7: "f32[1, 24, 2, 16]" = aten.cat([rms_norm_2, rms_norm], 1)             # joint [text, image]
    mul_13: "f32[1, 24, 2, 16]" = aten.mul(cat_7, unsqueeze_9)                   # rotary cos
    scaled_dot_product_attention: "f32[1, 2, 24, 16]" = aten.scaled_dot_product_attention(permute, ...)
    slice_8: "f32[1, 16, 32]" = aten.slice(add_39, 1, 8, 9223372036854775807)    # image, last block

after ``Ulysses(size=2)``, rank 0::

    shard_sequence: "f32[1, 8, 32]" = shard_sequence(linear, 1, [0], [8])       # 8 of 16 image tokens
    cat_7: "f32[1, 12, 2, 16]" = aten.cat([rms_norm_2, rms_norm], 1)             # [text shard, image shard]
    shard_sequence_2: "f32[1, 12, 1, 16]" = shard_sequence(unsqueeze_9, 1, [0, 8], [4, 8])  # same layout
    mul_13: "f32[1, 12, 2, 16]" = aten.mul(cat_7, shard_sequence_2)
    ulysses_attention: "f32[1, 2, 12, 16]" = ulysses_attention(permute, permute_1, permute_2, None, '0',
                                                              [12, 12], None, [0, 2, 1, 3])
    slice_8: "f32[1, 8, 32]" = aten.slice(add_39, 1, 4, 12, 1)                  # local segment boundary
    gather_sequence: "f32[1, 16, 32]" = gather_sequence(slice_8, 1, '0', [8, 8], [], [])   # 1 all_gather

Per attention: Ulysses 4 all-to-alls, Ring ``size - 1`` K/V exchanges (``rotate_method="allgather"``: one
all-gather; ``Ulysses(float8=True)``: the all-to-alls in e4m3; ``Ulysses(async_qkv=True)`` / ``USP(ulysses_async=True)``: the q / k / v ones
as graph nodes, each waited for after the next projection, :mod:`~dit_passes.parallel.ulysses_async`), USP both;
one all-gather per value leaving the block range or read whole by a non-local op (``nonlocal_gathers``), one
all-reduce per partial sum over the tokens (linear attention). Meshes are cached in the runtime state (a new signature
reuses them).
"""
from __future__ import annotations

import collections
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..parallel import sequence_ops as ops
from ..parallel.attention import ROTATE_METHODS
from ..parallel.mesh import ParallelMesh, check_ranks, factorisations
from ..parallel.propagate import PropagationError
from ..parallel.sequence_rewrite import apply_plan
from ..parallel.sequence_sharding import SequenceShardSpec, analyze
from ..parallel.ulysses_async import AsyncUlysses

__all__ = ["Ulysses", "Ring", "USP"]


class _ContextParallel(Pass):
    phase = Phase.SHARD_SEQUENCE
    reads = ("structure",)
    writes = ("parallel_group", "mesh")
    invalidates = ("structure",)
    ring_size = ulysses_size = 1
    attention_groups: Tuple[str, ...] = ()  # mesh dims of the attention wrapper's group arguments
    group: Optional[dist.ProcessGroup] = None  # the ranks that share the sequence (default: the world)
    ring_rotate_method = "p2p"  # how ring attention's K / V travel: p2p exchanges, or one all-gather
    ulysses_float8 = False      # the Ulysses all-to-alls in e4m3 rows + per-row scales (approximate)
    ulysses_async = False       # the q / k / v all-to-alls issued early, overlapped with the next projection

    @property
    def attention_op(self) -> str:
        """The name of the attention wrapper in :mod:`~dit_passes.parallel.sequence_ops` this pass inserts."""
        fp8 = "_fp8" if self.ulysses_float8 and self.ulysses_size > 1 else ""
        gathered = "_allgather" if self.ring_rotate_method == "allgather" and self.ring_size > 1 else ""
        return f"{self.name}{fp8}{gathered}_attention"

    def async_form(self) -> Optional[AsyncUlysses]:
        """With ``ulysses_async``: the async all-to-alls' form (the attention wrapper after them is the
        ``attention_op`` name with ``_received``), else None."""
        if not self.ulysses_async:
            return None
        received = getattr(ops, self.attention_op.replace("_attention", "_received_attention"))
        return AsyncUlysses(self.ulysses_size, self.ulysses_float8, received)

    def config_items(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _mesh(self, ctx: PassContext) -> ParallelMesh:
        meshes = ctx.runtime.state.setdefault("context_parallel_meshes", {})
        key = (self.ring_size, self.ulysses_size, None if self.group is None else self.group.group_name)
        if key not in meshes:  # collective: every rank lowers the same signatures in the same order
            meshes[key] = ParallelMesh((("ring", self.ring_size), ("ulysses", self.ulysses_size)), group=self.group)
        return meshes[key]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        total = self.ring_size * self.ulysses_size
        if total == 1:
            return PassResult(False, {}, f"{self.describe()}: one rank, nothing to shard: no-op, graph unchanged")
        if not (dist.is_available() and dist.is_initialized()):
            raise PassError(f"{self.describe()} needs an initialised torch.distributed process group with "
                            f"{total} ranks: launch one process per device (torchrun, Ray, or "
                            f"dit_passes.testing.run_ranks) and call torch.distributed.init_process_group first")
        world = dist.get_world_size(self.group)
        if total != world:
            pairs = ", ".join(f"USP(ulysses={u}, ring={r})" for u, r in factorisations(world, 2))
            raise PassError(f"{self.describe()} shards over {total} ranks, but the process group has world size "
                            f"{world}; valid for {world} ranks: Ulysses(size={world}), Ring(size={world}), {pairs} "
                            f"(for a hybrid with tensor parallelism, pass the context-parallel subgroup: "
                            f"dit_passes.passes.parallel_plan.hybrid_passes)")
        mesh = self._mesh(ctx)
        spec = SequenceShardSpec(world, mesh.global_rank)
        plan = analyze(gm, get_structure(gm), spec)
        try:
            counts = apply_plan(gm, plan, mesh.parent.group_name, getattr(ops, self.attention_op),
                                [mesh.group(d).group_name for d in self.attention_groups], self.async_form())
        except PropagationError as e:
            raise PassError(f"{self.describe()}: the rewritten graph would fail: {e}. The sequence-sharding rules "
                            f"accepted an op whose local form cannot run; report the model") from e
        facts = facts_of(gm)
        facts.parallel_group, facts.mesh = mesh.parent, mesh
        n = counts["attention_replaced"]
        counts["all_to_all"] = 4 * n if self.ulysses_size > 1 else 0
        by_gather = self.ring_rotate_method == "allgather" and self.ring_size > 1
        counts["ring_exchange"] = 0 if by_gather else (self.ring_size - 1) * n
        counts["all_gather"] = counts["outputs_gathered"] + counts["nonlocal_gathers"] + (n if by_gather else 0)
        nonlocal_ops = plan.all_nonlocal_ops()
        why = "; ".join(f"{node.name}: {reason}" for node, reason in nonlocal_ops[:3])
        report = (f"rank {spec.rank}/{world}: sharded {counts['inputs_sharded']} residual stream(s), replaced "
                  f"{n} attention(s) by {self.name} attention ({counts['attention_local']} over full keys stay "
                  f"local), sliced {counts['operands_sliced']} replicated operand(s), permuted "
                  f"{counts['masks_permuted']} mask(s), all-reduced {counts['all_reduce']} partial sum(s), "
                  f"gathered {counts['outputs_gathered']} output(s)"
                  + (f"; {counts['nonlocal_gathers']} gather(s) for {len(nonlocal_ops)} non-local op(s) ({why})"
                     if why else ""))
        return PassResult(True, counts, report)


class _OneAxis(_ContextParallel):
    """Context parallelism over ``size`` ranks of one kind: sets ``<name>_size``."""

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        setattr(self, f"{self.name}_size", check_ranks(f"{type(self).__name__}(size)", size))

    def config_items(self) -> Dict[str, Any]:
        return {"size": getattr(self, f"{self.name}_size")}


class Ulysses(_OneAxis):
    """DeepSpeed-Ulysses sequence parallelism over ``size`` ranks (all-to-all heads <-> sequence). ``float8=True``:
    the all-to-alls move e4m3 rows with a per-row fp32 scale (about half of bf16's bytes; approximate).
    ``async_qkv=True``: each of v, q, k is sent (``_c10d_functional.all_to_all_single``) as soon as it is
    projected and waited for (``wait_tensor``) after the next one is, so the all-to-alls overlap the projections
    (:mod:`~dit_passes.parallel.ulysses_async`; same collectives, same bits as synchronous Ulysses, with
    ``float8`` as synchronous float8 Ulysses)."""

    name = "ulysses"
    attention_groups = ("ulysses",)

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None, float8: bool = False,
                 async_qkv: bool = False):
        super().__init__(size, group)
        self.ulysses_float8 = bool(float8)
        self.ulysses_async = bool(async_qkv)

    def config_items(self) -> Dict[str, Any]:
        return {"size": self.ulysses_size, "float8": self.ulysses_float8, "async_qkv": self.ulysses_async}


class Ring(_OneAxis):
    """Ring attention over ``size`` ranks (K/V blocks rotate, log-sum-exp merge). ``rotate_method="allgather"``
    brings every K/V block by one all-gather per attention instead of ``size - 1`` exchanges (same result)."""

    name = "ring"
    attention_groups = ("ring",)

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None, rotate_method: str = "p2p"):
        super().__init__(size, group)
        self.ring_rotate_method = _rotate_method("Ring(rotate_method)", rotate_method)

    def config_items(self) -> Dict[str, Any]:
        return {"size": self.ring_size, "rotate_method": self.ring_rotate_method}


class USP(_ContextParallel):
    """Unified sequence parallelism: Ulysses (inner, consecutive ranks) inside Ring, ``ulysses * ring`` ranks.
    ``ulysses_async=True``: the q / k / v all-to-alls over the Ulysses group as in ``Ulysses(async_qkv=True)``
    (same collectives, same bits as synchronous USP)."""

    name = "usp"
    attention_groups = ("ulysses", "ring")

    def __init__(self, ulysses: int, ring: int, group: Optional[dist.ProcessGroup] = None,
                 ring_rotate_method: str = "p2p", ulysses_float8: bool = False, ulysses_async: bool = False):
        self.group = group
        self.ulysses_size = check_ranks("USP(ulysses)", ulysses)
        self.ring_size = check_ranks("USP(ring)", ring)
        self.ring_rotate_method = _rotate_method("USP(ring_rotate_method)", ring_rotate_method)
        self.ulysses_float8 = bool(ulysses_float8)
        self.ulysses_async = bool(ulysses_async)

    def config_items(self) -> Dict[str, Any]:
        return {"ulysses": self.ulysses_size, "ring": self.ring_size, "ring_rotate_method": self.ring_rotate_method,
                "ulysses_float8": self.ulysses_float8, "ulysses_async": self.ulysses_async}


def _rotate_method(where: str, method: str) -> str:
    if method not in ROTATE_METHODS:
        raise ValueError(f"{where}={method!r}: use one of {', '.join(map(repr, ROTATE_METHODS))} (p2p: size - 1 "
                         "K/V exchanges per attention; allgather: one all-gather of K/V)")
    return method


def describe_collectives(gm: fx.GraphModule) -> Dict[str, int]:
    """Count the context-parallel nodes in a graph by kind (what a printed graph shows)."""
    kinds = {getattr(ops, k): k for k in ("ulysses_attention", "ring_attention", "usp_attention", "gather_sequence",
                                          "shard_sequence", "permute_sequence", "ring_allgather_attention",
                                          "usp_allgather_attention", "ulysses_fp8_attention", "usp_fp8_attention",
                                          "usp_fp8_allgather_attention", "ulysses_received_attention",
                                          "ulysses_fp8_received_attention", "usp_received_attention",
                                          "usp_fp8_received_attention", "usp_allgather_received_attention",
                                          "usp_fp8_allgather_received_attention")}
    return dict(collections.Counter(kinds[n.target] for n in gm.graph.nodes
                                    if n.op == "call_function" and n.target in kinds))
