"""What tensor parallelism shards, decided from the graph before anything is rewritten.

For each column-parallel candidate (the structure's ``q`` / ``k`` / ``v`` / ``qkv`` / ``mlp_up`` linears of the
blocks), :func:`plan_columns` decides one of

* **shard** its output features, in the segments the graph cuts them into (:func:`output_segments`: a fused
  QKV's ``chunk(3)``, a SwiGLU's ``x[..., :h]`` / ``x[..., h:]``, a view ``(B, S, 3, H, D)`` whose ``3`` is
  then selected), every rank holding its chunk of each segment;
* **replicate** it, with the reason: its output reaches another column-parallel linear's input before any
  linear (a projection that writes the residual stream though its role says ``mlp_up``, e.g. a skip or
  conditioning input projection: sharding it would shard the residual stream), or it is an unfused k / v
  projection with fewer kv heads than ranks (GQA: every rank computes the kv heads and the attention takes the
  ones its q heads read);
* **pad** it: an MLP up projection whose hidden size does not divide by tp, when the graph proves that its
  output reaches only the down projection's input, through ops that are finite at 0 (:func:`padded_region`).
  Each segment gets zero rows (weight and bias) up to a multiple of tp, the down projection zero columns,
  so the padded units contribute exactly 0 to the down projection's sum;
* **pad its heads**: a q / k / v / qkv projection (or one of an attention other than SDPA, which the structure
  leaves the ``mlp_up`` role, e.g. Sana's linear attention) whose head count does not divide by tp: each segment
  of whole heads gets zero heads (rows and bias) up to a multiple of ``tp * head_dim``, so every rank's chunk is
  whole heads and head ``h`` of q still attends with head ``h`` of k and v; the output projection gets zero
  columns for them. Why this is exact (the padded heads stay finite, never mix with the real ones, and are
  exactly zero where an RMSNorm runs over all heads) is proven over the dataflow by
  :func:`~dit_passes.parallel.tp_heads.head_region` before anything is rewritten; the values proven zero are
  :attr:`TPPlan.zero`, which the rules require where statistics cross the padded heads. A k / v projection with
  fewer kv heads than its q whose count does not divide (GQA) stays replicated as above; its q is padded where the
  graph repeats the kv heads to the q heads before the attention (Lumina-Next's one kv head: the repeated heads
  are sliced to the rank's q heads and zero-padded alike), and refused where the attention itself takes fewer kv
  heads: the padded layout would no longer map q heads to their kv heads.

Anything else that does not divide is refused with the sizes that would.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Dict, List, Optional, Set, Tuple

import torch.fx as fx

from ..infra.pass_base import PassError
from . import op_classes as oc
from .propagate import arg, split_dim, split_sizes, val
from .tp_heads import HeadPaddingError, attention_head_dim, head_region, padded_head_segments

aten = oc.aten
HEAD_ROLES = ("q", "k", "v", "qkv")


@dataclasses.dataclass(frozen=True)
class ColumnPlan:
    site: object                  # the structure's LinearSite
    segments: Tuple[int, ...]     # output segments, as the graph cuts them
    padded: Tuple[int, ...]       # each rounded up to a multiple of tp (== segments unless padded)
    head_dim: int = 0             # > 0: padded with whole zero heads of this size (an attention projection)


@dataclasses.dataclass
class TPPlan:
    columns: List[ColumnPlan]
    replicated: Dict[str, str]    # module path -> why it stays replicated
    zero: Set[fx.Node] = dataclasses.field(default_factory=set)  # values whose padded heads are exactly 0

    @property
    def padded(self) -> List[ColumnPlan]:
        return [c for c in self.columns if c.padded != c.segments]

    @property
    def padded_heads(self) -> List[ColumnPlan]:
        return [c for c in self.padded if c.head_dim]


def divisors(n: int) -> List[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


# -------------------------------------------------------------------------------------- segments
def output_segments(linear: fx.Node) -> Tuple[int, ...]:
    """Segments of a column-parallel linear's output features: the pieces the graph cuts its last dim into
    (splits and chunks, slices, a view that stacks fused components along a dim it then indexes), each
    sharded on its own so that after the cut every rank holds matching heads of q, k and v (and matching
    columns of gate and value). No cut: one segment."""
    full = int(val(linear).shape[-1])
    cuts = sorted(_cuts(linear, val(linear).dim() - 1, full, 0) | {0, full})
    return tuple(b - a for a, b in zip(cuts, cuts[1:]))


def slice_range(n: fx.Node, full: int) -> Optional[Tuple[int, int]]:
    if int(arg(n, 4, "step", 1)) != 1:
        return None
    start, end = arg(n, 2, "start", None), arg(n, 3, "end", None)
    start = 0 if start is None else int(start)
    end = full if end is None else int(end)
    start, end = (max(0, min(full, v + full if v < 0 else v)) for v in (start, end))
    return start, max(start, end)


def _cuts(node: fx.Node, dim: int, full: int, base: int) -> Set[int]:
    """Cut points (offset by ``base``) of ``node``'s dim ``dim`` (of ``full`` elements) made by its users."""
    out: Set[int] = set()
    for u in node.users:
        if u.target in oc.SPLITS and split_dim(u) == dim:
            sizes = split_sizes(u, full)
            starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            out.update(base + s for s in starts)
            for g in u.users:
                if g.target is operator.getitem:
                    i = g.args[1]
                    out |= _cuts(g, dim, sizes[i], base + starts[i])
        elif u.target is aten.slice.Tensor and int(arg(u, 1, "dim", 0)) % val(node).dim() == dim:
            rng = slice_range(u, full)
            if rng is not None:
                out.update((base + rng[0], base + rng[1]))
                out |= _cuts(u, dim, rng[1] - rng[0], base + rng[0])
        elif u.target in oc.SIZE_VIEWS | {aten.unflatten.int} and dim == val(node).dim() - 1:
            count = _stacked(u, dim, full)
            if count:
                out.update(base + full // count * i for i in range(count + 1))
    return out


def _stacked(view: fx.Node, dim: int, full: int) -> int:
    """How many components a view of the last dim ``dim`` stacks along a new dim that the graph then indexes
    (``(B, S, 3*H*D) -> (B, S, 3, H, D)``, then ``select`` / ``unbind`` along the 3), else 0."""
    src, dst = [int(s) for s in val(view.args[0]).shape], [int(s) for s in val(view).shape]
    pre = math.prod(src[:dim])
    for e, count in enumerate(dst):
        if math.prod(dst[:e]) == pre and 1 < count < full and full % count == 0 and math.prod(dst[e:]) == full:
            return count if _indexed(view, e) else 0
    return 0


def _indexed(node: fx.Node, dim: int) -> bool:
    """Whether a user of ``node`` (through permutes / transposes) selects, unbinds or splits along ``dim``."""
    for u in node.users:
        t, nd = u.target, val(node).dim()
        if t is aten.permute.default and _indexed(u, [int(p) % nd for p in u.args[1]].index(dim)):
            return True
        if t is aten.transpose.int:
            a, b = (int(v) % nd for v in u.args[1:3])
            if _indexed(u, b if dim == a else a if dim == b else dim):
                return True
        if t in (aten.select.int, aten.unbind.int) and int(arg(u, 1, "dim", 0)) % nd == dim:
            return True
        if t in oc.SPLITS and split_dim(u) == dim:
            return True
    return False


# -------------------------------------------------------------------------------------- dataflow
def _data_users(v: fx.Node):
    """Users that read ``v``'s values (not a type_as / expand_as / *_like that takes only its dtype or shape)."""
    for u in v.users:
        if not (u.target in oc.VALUE_FREE or (u.target in oc.META_ARG1 and u.args[0] is not v)):
            yield u


def reaches_column(site_node: fx.Node, columns: Set[fx.Node]) -> Optional[fx.Node]:
    """The column-parallel linear whose input ``site_node``'s output reaches before any linear, if any."""
    seen, todo = {site_node}, [site_node]
    while todo:
        v = todo.pop()
        for u in _data_users(v):
            if u.target is oc.LINEAR:
                if u in columns and u.args[0] is v:
                    return u
                continue
            if u not in seen and u.op == "call_function":
                seen.add(u)
                todo.append(u)
    return None


def _kv_heads(site, structure) -> Tuple[Optional[int], Optional[int]]:
    """(heads of an unfused k / v projection, q heads of the attention it feeds): its features over the head size
    of the attention site of its block whose module path contains it; (None, None) when there is none."""
    path = site.module_path
    owners = [a for a in structure.attention if a.block == site.block
              and path.startswith(a.node.meta.get("dit_module_path", "\0") + ".")]
    if not owners:
        return None, None
    owner = max(owners, key=lambda a: len(a.node.meta.get("dit_module_path", "")))
    head_dim = owner.head_dim
    heads = site.out_features // head_dim if head_dim and site.out_features % head_dim == 0 else None
    return heads, owner.num_heads


def padded_region(up: fx.Node) -> Tuple[Set[fx.Node], List[fx.Node], Optional[str]]:
    """(values that carry an MLP up projection's hidden, the linears reading it as their input, or the reason
    the padded units could leak): the hidden may pass only through ops keeping it the last dim and finite
    at 0 (:data:`~op_classes.FINITE_POINTWISE`, casts and copies, splits, slices) to linears' inputs."""
    region, downs, todo = {up}, [], [up]
    while todo:
        v = todo.pop()
        for u in _data_users(v):
            t = u.target
            if t is oc.LINEAR:
                if u.args[0] is not v:
                    return region, downs, f"{u.name} reads it as a weight"
                downs.append(u)
                continue
            if t is aten.div.Tensor and u.args[1] is v:
                return region, downs, f"{u.name} divides by it"
            if t is aten.pow.Tensor_Scalar and not float(u.args[1]) >= 0:
                return region, downs, f"{u.name} raises it to a negative power"
            if not (t in oc.FINITE_POINTWISE or t in oc.LIKE_ARG0 or t in oc.SPLITS or t is operator.getitem
                    or t is aten.slice.Tensor or t is aten.div.Tensor):
                return region, downs, f"{u.name} ({t}) reads it before the down projection"
            if u not in region:
                region.add(u)
                todo.append(u)
    return region, downs, None if downs else "no linear reads it"


def _check_operands(region: Set[fx.Node]) -> Optional[str]:
    """Every other tensor operand of a pointwise op of the region must be broadcast along the hidden."""
    for u in region:
        if u.target not in oc.FINITE_POINTWISE and u.target is not aten.div.Tensor:
            continue
        for a in u.args:
            if isinstance(a, fx.Node) and a not in region and val(a) is not None and val(a).dim() and \
                    int(val(a).shape[-1]) != 1:
                return f"{u.name} combines it with {a.name}, which has the full hidden size"
    return None


# -------------------------------------------------------------------------------------- the plan
def plan_columns(structure, tp: int) -> TPPlan:
    """The plan (see the module docstring); PassError for a size that neither divides nor can be padded."""
    sites = structure.column_parallel_linears()
    columns = {s.node for s in sites}
    plans, replicated, pad_sites, head_sites = [], {}, [], []
    for site in sites:
        if site.out_features == 0:
            replicated[site.module_path] = "it has no output features"
            continue
        reached = reaches_column(site.node, columns)
        if reached is not None:
            replicated[site.module_path] = (f"its output reaches column-parallel {reached.name} "
                                            f"({reached.meta.get('dit_module_path', '?')}) before any linear")
            continue
        if site.role in ("k", "v"):
            heads, q_heads = _kv_heads(site, structure)
            if heads is not None and heads % tp and heads != q_heads:
                replicated[site.module_path] = (f"{heads} kv head(s) do not divide by tp={tp}: every rank "
                                                f"computes them, the attention takes its q heads' ones")
                continue
        segments = output_segments(site.node)
        # (an attention other than SDPA, e.g. Sana's linear attention, leaves its projections the mlp_up role)
        padded = _head_padding(site, segments, tp) if site.role in HEAD_ROLES + ("mlp_up",) else None
        if padded is not None and padded[0] != segments:
            head_sites.append(ColumnPlan(site, segments, *padded))
        elif all(s % tp == 0 for s in segments):
            plans.append(ColumnPlan(site, segments, segments))
        else:
            pad_sites.append((site, segments))
    plans += _plan_mlp_padding(pad_sites, tp)
    zero = set()
    for head_dim in sorted({c.head_dim for c in head_sites}):
        zero |= _prove_head_padding([c for c in head_sites if c.head_dim == head_dim], head_dim, tp)
    return TPPlan(plans + head_sites, replicated, zero)


def _head_padding(site, segments: Tuple[int, ...], tp: int) -> Optional[Tuple[Tuple[int, ...], int]]:
    """(padded segments, head size) of a q / k / v / qkv projection (segments of whole heads rounded up to whole
    heads on every rank), None when it feeds no attention; PassError when a segment cannot be padded."""
    try:
        head_dim = attention_head_dim(site.node)
        return None if head_dim is None else (padded_head_segments(segments, head_dim, tp), head_dim)
    except HeadPaddingError as e:
        raise PassError(f"tensor_parallel: {site.role} linear {site.module_path}: size(s) {list(segments)} do not "
                        f"divide by tp={tp} and zero-padding its heads is refused: {e}; tensor-parallel sizes "
                        f"that divide them: {divisors(math.gcd(*segments))}") from None


def _prove_head_padding(plans: List[ColumnPlan], head_dim: int, tp: int) -> Set[fx.Node]:
    """Check (tp_heads.head_region) that the padded heads of ``plans`` (one head size) contribute exactly 0;
    the values proven exactly zero there. PassError naming the projections and the op otherwise."""
    try:
        region = head_region([c.site.node for c in plans], head_dim)
    except HeadPaddingError as e:
        sites = ", ".join(f"{c.site.module_path} {list(c.segments)}" for c in plans[:4])
        raise PassError(f"tensor_parallel: attention heads of {head_dim} that do not divide by tp={tp} ({sites}"
                        f"{', ...' if len(plans) > 4 else ''}), and zero-padding them to whole heads per rank is "
                        f"refused: {e}; tensor-parallel sizes that divide the head counts: "
                        f"{divisors(math.gcd(*[s // head_dim for c in plans for s in c.segments]))}") from None
    return region.zero


def _plan_mlp_padding(pad_sites, tp: int) -> List[ColumnPlan]:
    """Zero-padded MLP hiddens (module docstring); PassError for a size that neither divides nor can be padded."""
    region: Set[fx.Node] = set()
    plans = []
    for site, segments in pad_sites:
        what = (f"tensor_parallel: {site.role} linear {site.module_path}: size(s) {list(segments)} are not "
                f"divisible by tp={tp}")
        works = f"tensor-parallel sizes that divide them: {divisors(math.gcd(*segments))}"
        if site.role != "mlp_up":
            raise PassError(f"{what}; {works}")
        part, _, why = padded_region(site.node)
        if why is not None:
            raise PassError(f"{what}, and zero-padding the MLP hidden is refused: {why}; {works}")
        region |= part
        plans.append(ColumnPlan(site, segments, tuple(-(-s // tp) * tp for s in segments)))
    why = _check_operands(region)
    if why is not None:
        raise PassError(f"tensor_parallel: zero-padding an MLP hidden to a multiple of tp={tp} is refused: {why}")
    return plans


def _sizes(c: ColumnPlan) -> str:
    heads = (f" (heads {[s // c.head_dim for s in c.segments]} -> {[s // c.head_dim for s in c.padded]} of "
             f"{c.head_dim})") if c.head_dim else ""
    return f"{list(c.segments)} -> {list(c.padded)}{heads}"


def describe_padding(plan: TPPlan) -> List[str]:
    """One line per padded projection: its segments before and after, in heads for an attention projection."""
    return [f"{c.site.module_path} {_sizes(c)}" for c in plan.padded]


def padding_summary(columns: List[ColumnPlan]) -> str:
    """The padded projections ``columns`` grouped by their sizes: ``sizes at N linear(s): module paths`` (a
    module applied twice is one path)."""
    by_sizes: Dict[str, List[str]] = {}
    for c in columns:
        by_sizes.setdefault(_sizes(c), []).append(c.site.module_path)
    return "; ".join(f"{sizes} at {len(paths)} linear(s): {', '.join(dict.fromkeys(paths))}"
                     for sizes, paths in by_sizes.items())


__all__ = ["ColumnPlan", "TPPlan", "describe_padding", "divisors", "output_segments", "padded_region",
           "padding_summary", "plan_columns", "reaches_column", "slice_range"]
