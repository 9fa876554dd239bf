"""The residual-cache rewrite every block-range cache pass shares: cut, branch, decide, commit, state I/O.

A cache pass (``DBCache``, ``FirstBlockCache``, ``MagCache``, ``SeaCache``, ``TeaCache``) picks the cut (Fn
leading blocks always run, Bn trailing blocks always run, the middle is cached) and a
:class:`~dit_passes.cache.program.CacheProgram` (its state and decision rule); :func:`insert_cache_branch` writes, under the pass's name ``<name>``::

    fn_residual = <stream after the Fn blocks> - <stream entering block 0>     # only if the rule reads it
    decide = self.<name>_decide(fn_residual, timestep, *cache_state)           # device-side, no .item()
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.<name>_cached, self.<name>_compute,
                                       (*live_in, *hit_values))
    new_state = self.<name>_commit(use_cache, *middle_residuals, *decided_state)
    return (*user_outputs, *new_state, use_cache, diff)

The cached arm adds ``hit_values`` to the streams (and returns them as the middle residuals). A program whose hit
values are a calibrator's prediction (``program.hit_keys`` set) passes the decided state tensors the prediction
reads instead, ``(*live_in, *decided_state[hit_keys])``, and the cached arm calls ``hit = self.hit(*those)`` first
(its submodule, the program's ``hit``): a computed step never forms the prediction.

and registers the state with a :class:`~dit_passes.cache.store.CacheStore` (``runtime.state[<name>]``, also
the pass's report). With ``Fn = 0`` the whole block range is the middle (MagCache) and the cut is the
streams entering block 0. The attention-level caches (TaylorSeer, PAB, FasterCache) share ``module_sites`` /
``site_io`` / ``module_arm``: one module's run of nodes, its inputs and outputs, and its compute arm. Not a pass: a
helper of the cache passes, as ``segments`` is.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..analysis.blocks import get_structure
from ..infra.facts import CacheCut, StateIO, facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from .segments import MiddleSegment, cut_middle, keep_loads_with_blocks


def _branch(gm: fx.GraphModule, seg: MiddleSegment, k: int, cached: bool, name: str, hit_inputs=None,
            hit=None) -> fx.GraphModule:
    """The two arms of the cond. Operands: (*live_in, *residual_to_use[k]), or with ``hit_inputs`` (the decided
    state's ``(name, value)`` pairs ``hit`` reads) (*live_in, *those): the cached arm forms the k residuals with
    ``hit``. Outputs: (*live_out, *residual[k])."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    root = torch.nn.Module()
    for a in seg.live_in:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    if hit_inputs is None:
        res_in = [g.placeholder(f"residual_{i}") for i in range(k)]
        for r, o in zip(res_in, seg.live_out):
            r.meta["val"] = o.meta["val"]
    else:
        state_in = [g.placeholder(f"hit_{n}") for n, _ in hit_inputs]
        for ph, (_, v) in zip(state_in, hit_inputs):
            ph.meta["val"] = v
        res_in = []
        if cached:  # the prediction, in this arm only
            root.add_module("hit", hit)
            call = g.call_module("hit", tuple(state_in))
            res_in = [g.call_function(operator.getitem, (call, i)) for i in range(k)]
            for r, o in zip(res_in, seg.live_out):
                r.meta["val"] = o.meta["val"]
    def base(o: fx.Node):
        """The node the residual of ``o`` is taken against (None: ``o`` is cached whole)."""
        b = seg.before_of[o]
        if len(b.parts) == 1:
            return env[b.parts[0]]
        if not b.parts:
            return None
        return g.call_function(torch.ops.aten.cat.default, ([env[p] for p in b.parts], b.dim))

    if cached:
        outs = []
        for o, r in zip(seg.live_out, res_in):
            against = base(o)
            outs.append(g.call_function(torch.ops.aten.clone.default, (r,)) if against is None
                        else g.call_function(torch.ops.aten.add.Tensor, (against, r)))
        res = [g.call_function(torch.ops.aten.clone.default, (r,)) for r in res_in]  # outputs may not alias inputs
    else:
        from ..infra.graph_utils import _share_attr

        def lookup(a: fx.Node) -> fx.Node:
            if a not in env:
                if a.op != "get_attr":
                    raise PassError(f"{name}: '{a.name}' is used by the middle blocks but not available")
                _share_attr(gm, root, a.target)
                env[a] = g.get_attr(a.target)
            return env[a]

        for n in seg.nodes:
            env[n] = g.node_copy(n, lookup)
        # both arms must return tensors of the same layout: a stream that leaves the middle as a view (Flux's
        # single blocks end with a slice of the joint sequence) is copied to a fresh contiguous tensor
        outs = [g.call_function(torch.ops.aten.clone.default, (env[o],), {"memory_format": torch.contiguous_format})
                if _is_view_like(o) else env[o] for o in seg.live_out]
        res = []
        for o in seg.live_out:
            against = base(o)
            res.append(g.call_function(torch.ops.aten.clone.default, (env[o],)) if against is None
                       else g.call_function(torch.ops.aten.sub.Tensor, (env[o], against)))
    g.output(tuple(outs + res))
    return fx.GraphModule(root, g, class_name="CacheBranchCached" if cached else "CacheBranchCompute")


def _is_view_like(n: fx.Node) -> bool:
    """Not laid out as a fresh contiguous tensor: an offset, or any stride off the contiguous ones, a size-1 dim's
    included (``is_contiguous`` ignores those, but the cond's two arms must agree on every stride)."""
    v = n.meta["val"]
    want, acc = [], 1
    for size in reversed(v.shape):
        want.append(acc)
        acc *= size
    return v.storage_offset() != 0 or tuple(v.stride()) != tuple(reversed(want))


def _compute_arm_vals(seg: MiddleSegment, mode) -> List[torch.Tensor]:
    """The compute arm's output values (what :func:`_branch` returns with ``cached=False``) from the segment's own
    metadata: the arm's nodes are copies of the segment's, so only the ops it adds at its end (contiguous copies,
    residuals) run on fake tensors. A fake run of the whole arm costs seconds at FLUX size."""
    outs, res = [], []
    with mode:
        for o in seg.live_out:
            v = o.meta["val"]
            outs.append(torch.ops.aten.clone.default(v, memory_format=torch.contiguous_format) if _is_view_like(o)
                        else torch.ops.aten.clone.default(v))
            parts = [p.meta["val"] for p in seg.before_of[o].parts]
            if not parts:
                res.append(torch.ops.aten.clone.default(v))
            else:
                against = parts[0] if len(parts) == 1 else torch.ops.aten.cat.default(parts, seg.before_of[o].dim)
                res.append(torch.ops.aten.sub.Tensor(v, against))
    return outs + res


def _view_root(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` views: up through ops whose schema says their output aliases their input (slice,
    view, select, split + getitem, ...)."""
    while n.op == "call_function":
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        op = src.target if n.target is operator.getitem and src is not None else n.target
        schema = getattr(op, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if src is None or alias is None or alias.is_write:
            return n
        n = src if n.target is not operator.getitem else src.args[0]
        if not isinstance(n, fx.Node):
            return src
    return n


def dealias_live_in(gm: fx.GraphModule, seg: MiddleSegment) -> MiddleSegment:
    """``seg`` with each value entering it that shares storage with an earlier one replaced by its own contiguous
    copy. ``torch.compile`` refuses a cond whose operands alias each other, and a
    single-stream block ends by splitting its joint sequence back into two views of one tensor (FLUX's single
    blocks), so a cut after one would hand the cond two views of one storage. Elsewhere nothing changes."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen, copies = set(), {}
    for a in seg.live_in:
        v = a.meta["val"]
        # by the graph (views of one node: a graph restored from the trace cache has fresh, unaliased fake values)
        # and by the values (aliasing the graph does not show, e.g. through an opaque op)
        refs = {("node", _view_root(a)), ("storage", StorageWeakRef(v.untyped_storage()))}
        if refs & seen:
            # right after the value: it may sit inside the range (a load kept outside the cut) or in an earlier cut
            with gm.graph.inserting_after(a):
                c = gm.graph.call_function(torch.ops.aten.clone.default, (a,),
                                           {"memory_format": torch.contiguous_format}, name=f"{a.name}_own")
            with detect_fake_mode([v]):
                c.meta["val"] = torch.ops.aten.clone.default(v, memory_format=torch.contiguous_format)
            copies[a] = c
        seen |= refs
    if not copies:
        return seg
    for n in seg.nodes:
        for a, c in copies.items():
            n.replace_input_with(a, c)

    def own(x: fx.Node) -> fx.Node:
        return copies.get(x, x)
    before_of = {o: dataclasses.replace(b, parts=tuple(own(p) for p in b.parts)) for o, b in seg.before_of.items()}
    return dataclasses.replace(seg, live_in=[own(a) for a in seg.live_in], before_of=before_of,
                               image_at_cut=own(seg.image_at_cut))


def _fake_call(fn, args, mode):
    from torch.utils._pytree import tree_map
    fakes = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, args)
    with mode:
        return fn(*fakes)



def module_path(n: fx.Node) -> str:
    return n.meta.get("dit_module_path") or ""


def module_sites(gm: fx.GraphModule, paths, name: str, advice: str) -> Dict[str, List[fx.Node]]:
    """Module path -> its nodes (graph order), for the attention-level caches (the branch sits around one
    module's run of nodes), in graph order; refuses nested paths and modules interleaved with other code."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    nested = [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
    if nested:
        raise PassError(f"{name}: matched modules nest ({nested[:3]}); {advice}")
    pos = {n: i for i, n in enumerate(calls)}
    sites: Dict[str, List[fx.Node]] = {}
    for m in paths:
        nodes = [n for n in calls if module_path(n) == m or module_path(n).startswith(m + ".")]
        if pos[nodes[-1]] - pos[nodes[0]] + 1 != len(nodes):
            raise PassError(f"{name}: module '{m}' is not one contiguous run of graph nodes (other code runs inside "
                            f"it); its outputs cannot be reused as a unit")
        sites[m] = nodes
    return dict(sorted(sites.items(), key=lambda kv: pos[kv[1][0]]))


def site_io(nodes: List[fx.Node], name: str, path: str):
    """``(live_in, live_out)`` of one module's nodes: the values it reads from outside (weights excluded) and
    those read after it; refuses non-tensor values crossing its border."""
    inside = set(nodes)
    live_in = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"))
    live_out = [n for n in nodes if any(u not in inside for u in n.users)]
    bad = [a.name for a in live_in + live_out if not isinstance(a.meta.get("val"), torch.Tensor)]
    if bad:
        raise PassError(f"{name}: module '{path}' exchanges non-tensor values {bad}")
    return live_in, live_out


def module_arm(gm: fx.GraphModule, nodes: List[fx.Node], live_in: List[fx.Node], live_out: List[fx.Node],
               num_extra: int, class_name: str) -> fx.GraphModule:
    """The compute arm of a module-level cond: ``(*live_in, *unused extras) -> live_out``, the module's nodes,
    weights shared with ``gm``."""
    from ..infra.graph_utils import _share_attr
    g, root, env = fx.Graph(), torch.nn.Module(), {}
    for a in live_in:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for i in range(num_extra):
        g.placeholder(f"unused_{i}")

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env:
            _share_attr(gm, root, a.target)
            env[a] = g.get_attr(a.target)
        return env[a]

    for n in nodes:
        env[n] = g.node_copy(n, lookup)
    # the other arm returns fresh contiguous tensors: both arms must agree on the layout
    outs = [g.call_function(torch.ops.aten.clone.default, (env[o],), {"memory_format": torch.contiguous_format})
            if _is_view_like(o) else env[o] for o in live_out]
    g.output(tuple(outs))
    return fx.GraphModule(root, g, class_name=class_name)


def add_state_inputs(gm: fx.GraphModule, program, device: torch.device, mode) -> List[fx.Node]:
    """One placeholder per state tensor of ``program`` (``cache_<name>``), after the user's inputs."""
    g = gm.graph
    last = [p for p in g.nodes if p.op == "placeholder"][-1]
    state_in: List[fx.Node] = []
    with g.inserting_after(last):
        for spec in reversed(program.input_spec):
            ph = g.placeholder(f"cache_{spec.name}")
            with mode:
                ph.meta["val"] = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            state_in.insert(0, ph)
    return state_in


def _getitems(g: fx.Graph, node: fx.Node, vals, names: Sequence[str]) -> List[fx.Node]:
    out = []
    for i, (v, name) in enumerate(zip(vals, names)):
        it = g.create_node("call_function", operator.getitem, (node, i), name=name)  # readable prints
        it.meta["val"] = v
        out.append(it)
    return out


def route_branches(gm: fx.GraphModule, name: str, program, split, state_out: Sequence[fx.Node],
                   device: torch.device):
    """Keep ``program``'s state once per CFG branch, the branch picked by each call in the graph
    (:mod:`dit_passes.cache.branches`)::

        route = self.<name>_route(timestep, hidden_states, route_on, *router, *slots)  # branch, router', working
        ... the program's own nodes, reading the working state (was: the cache_<state> inputs) ...
        slots' = self.<name>_merge(branch, *state_out, *slots)

    Returns ``(routed program, new state_out)``, or ``(program, state_out)`` unchanged where the graph has no
    ``timestep`` input (nothing tells the steps apart: one state)."""
    from ..cache.branches import RoutedProgram

    g = gm.graph
    phs = {p.target: p for p in g.nodes if p.op == "placeholder"}
    timestep, hidden = phs.get("timestep"), phs.get("hidden_states")
    if timestep is None:
        return program, list(state_out)
    if hidden is not None and not isinstance(hidden.meta.get("val"), torch.Tensor):
        hidden = None
    routed = RoutedProgram.build(program, split, None if hidden is None else hidden.meta["val"])
    old = [phs[f"cache_{spec.name}"] for spec in program.input_spec]
    mode = detect_fake_mode([p.meta["val"] for p in old])
    new_in = add_state_inputs(gm, routed, device, mode)
    route_mod, merge_mod = routed.route, routed.merge
    gm.add_submodule(f"{name}_route", route_mod)
    gm.add_submodule(f"{name}_merge", merge_mod)
    with g.inserting_before(new_in[-1].next):  # after every placeholder (add_state_inputs appends them last)
        args = (timestep, *([hidden] if hidden is not None else []), new_in[-1], *new_in[:-1])
        node = g.call_module(f"{name}_route", args)
        vals = _fake_call(route_mod, args, mode)
        node.meta["val"] = vals
        inner_names = [s.name for s in program.state_spec]
        extra = [s.name for s in program.input_spec[len(inner_names):]]
        items = _getitems(g, node, vals, ["cfg_branch"] + [f"next_{r}" for r in routed.router_names]
                          + [f"branch_{n}" for n in inner_names + extra])
    branch, router_out = items[0], items[1:1 + len(routed.router_names)]
    for ph, new in zip(old, items[1 + len(routed.router_names):]):
        ph.replace_all_uses_with(new)
        g.erase_node(ph)
    slots_in = new_in[len(routed.router_names):-1]
    with g.inserting_before(g.output_node()):
        args = (branch, *state_out, *slots_in)
        node = g.call_module(f"{name}_merge", args)
        vals = _fake_call(merge_mod, args, mode)
        node.meta["val"] = vals
        merged = _getitems(g, node, vals, [f"next_{s.name}" for s in routed.state_spec[len(routed.router_names):]])
    return routed, list(router_out) + merged


def finish_state_io(gm: fx.GraphModule, ctx: PassContext, name: str, make_store: Callable[[], object], program,
                    device: torch.device, state_out: Sequence[fx.Node], use_cache: fx.Node, diff: fx.Node,
                    cut=None, split=None) -> None:
    """Return ``(*user outputs, *state_out, use_cache, diff)``, register the program with the pass's store
    (``ctx.runtime.state[name]``, also its report) and the state I/O with ``facts.state_io``; dead code goes.
    ``split`` (a :class:`~dit_passes.cache.branches.BranchSplit`): keep the state per CFG branch, told apart in
    the graph (:func:`route_branches`)."""
    if split is not None:
        program, state_out = route_branches(gm, name, program, split, state_out, device)
    g = gm.graph
    out_node = g.output_node()
    user_outs = list(out_node.args[0])
    facts = facts_of(gm)
    prev_user = facts.num_user_outputs if facts.num_user_outputs is not None else len(user_outs)
    out_node.args = (tuple(user_outs) + tuple(state_out) + (use_cache, diff),)
    g.eliminate_dead_code()
    ctx.recompile_at_end(gm)
    store = ctx.runtime.state.get(name)
    if store is None:
        store = ctx.runtime.state[name] = make_store()
    ctx.runtime.register_report(name, store)
    graph_id = ctx.graph_id
    store.register_graph(graph_id, program, device, cut)
    facts.num_user_outputs = prev_user
    facts.inference_only = True
    facts.state_io.append(StateIO(inputs=lambda rt, _s=store, _g=graph_id: _s.inputs(_g, rt.context),
                                  outputs=lambda rt, vals, _s=store, _g=graph_id: _s.outputs(_g, rt.context, vals),
                                  num_outputs=len(state_out) + 2))


def insert_cache_branch(gm: fx.GraphModule, ctx: PassContext, *, name: str, fn: int, bn: int, tag: str,
                        make_program: Callable[..., object], make_store: Callable[[], object],
                        check_segment: Callable[[MiddleSegment], Optional[dict]] = lambda seg: None,
                        decide_input: Optional[Callable[[fx.GraphModule, MiddleSegment], fx.Node]] = None,
                        split=None) -> PassResult:
    """Rewrite ``gm`` as the module docstring shows. ``make_program(image_residual=, stream_residuals=,
    has_timestep=, group=)`` builds the graph's :class:`CacheProgram`; ``make_store()`` the store kept in
    ``ctx.runtime.state[name]`` (created once per runtime); ``check_segment`` may refuse a cut its rule
    cannot serve (raising :class:`PassError`) and returns extra keywords for ``make_program`` (or None).
    ``tag``: the config's tag, for the report line. ``decide_input(gm, seg)``: the node the decision reads
    instead of the Fn residual (called with the graph inserting before the cached range; SeaCache: an input,
    TeaCache: a copy of block 0's modulated input); ``make_program`` then gets its value as ``image_residual``.
    ``split``: keep the state per CFG branch (:func:`route_branches`)."""
    s = get_structure(gm)
    n = len(s.blocks)
    if fn + bn >= n:
        raise PassError(f"{name}: Fn_compute_blocks + Bn_compute_blocks = {fn} + {bn} must be smaller than "
                        f"the number of blocks ({n}, lists {[(b.name, b.count) for b in s.block_lists]}), "
                        f"so that at least one middle block can be cached")
    relocated, outside = keep_loads_with_blocks(gm, s, fn, bn, facts_of(gm).offload_loads)
    seg = dealias_live_in(gm, cut_middle(gm, s, fn, bn, exclude=outside))
    extra = check_segment(seg) or {}
    k = len(seg.live_out)
    g = gm.graph
    mode = detect_fake_mode([a.meta["val"] for a in seg.live_in])
    placeholders = [p for p in g.nodes if p.op == "placeholder"]
    timestep = next((p for p in placeholders if p.target == "timestep"), None)

    probe = None
    if decide_input is not None:
        with g.inserting_before(seg.nodes[0]):
            probe = decide_input(gm, seg)
    group = facts_of(gm).parallel_group  # set by the context/tensor-parallel passes
    program = make_program(image_residual=(probe if probe is not None else seg.image_at_cut).meta["val"],
                           stream_residuals=[o.meta["val"] for o in seg.live_out],
                           has_timestep=timestep is not None, group=group, **extra)
    gm.add_submodule(f"{name}_decide", program.decide)
    gm.add_submodule(f"{name}_commit", program.commit)

    state_in = add_state_inputs(gm, program, seg.image_at_cut.meta["val"].device, mode)
    state_names = [spec.name for spec in program.state_spec]
    getitems = functools.partial(_getitems, g)
    hit_keys = program.hit_keys
    n_hits = k if hit_keys is None else 0  # hit values decide returns

    first_after = seg.nodes[-1].next
    with g.inserting_before(seg.nodes[0]):
        if probe is not None:
            r = probe
        elif program.reads_fn_residual:
            r = g.create_node("call_function", torch.ops.aten.sub.Tensor, (seg.image_at_cut, seg.image_in),
                              name="fn_residual")
            with mode:
                r.meta["val"] = seg.image_at_cut.meta["val"] - seg.image_in.meta["val"]
        else:  # the rule ignores it: pass the stream itself rather than computing a difference
            r = seg.image_at_cut
        t_arg = timestep if timestep is not None else r
        d_args = (r, t_arg, *state_in)
        dec = g.call_module(f"{name}_decide", d_args)
        dec_vals = _fake_call(program.decide, d_args, mode)
        dec.meta["val"] = dec_vals
        dec_items = getitems(dec, dec_vals, ["use_cache", "residual_diff"]
                             + [f"hit_residual_{i}" for i in range(n_hits)] + [f"decided_{n}" for n in state_names])
        use_cache, diff = dec_items[0], dec_items[1]
        state_mid = dec_items[2 + n_hits:]
        if hit_keys is None:
            use_res, hit_inputs = dec_items[2:2 + k], None
        else:
            decided = dict(zip(state_names, state_mid))
            use_res = [decided[n] for n in hit_keys]
            hit_inputs = [(n, decided[n].meta["val"]) for n in hit_keys]
        gm.add_submodule(f"{name}_compute", _branch(gm, seg, k, cached=False, name=name, hit_inputs=hit_inputs))
        gm.add_submodule(f"{name}_cached", _branch(gm, seg, k, cached=True, name=name, hit_inputs=hit_inputs,
                                                   hit=None if hit_keys is None else program.hit))
        t_graph, f_graph = g.get_attr(f"{name}_cached"), g.get_attr(f"{name}_compute")
        operands = tuple(seg.live_in) + tuple(use_res)
        cond = g.call_function(torch.ops.higher_order.cond, (use_cache, t_graph, f_graph, operands))
        cond_vals = _compute_arm_vals(seg, mode)
        cond.meta["val"] = tuple(cond_vals)
        cond_items = getitems(cond, cond_vals, [f"stream_{i}" for i in range(k)] + [f"middle_residual_{i}" for i in range(k)])
    outs, new_res = cond_items[:k], cond_items[k:]
    for o, new in zip(seg.live_out, outs):
        o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in set(seg.nodes))
    with g.inserting_before(first_after):
        c_args = (use_cache, *new_res, *state_mid)
        com = g.call_module(f"{name}_commit", c_args)
        com_vals = _fake_call(program.commit, c_args, mode)
        com.meta["val"] = com_vals
        state_out = getitems(com, com_vals, [f"next_{n}" for n in state_names])
    for node in reversed(seg.nodes):
        g.erase_node(node)
    cut = CacheCut(fn, bn, n, len(seg.nodes), k)
    finish_state_io(gm, ctx, name, make_store, program, seg.image_at_cut.meta["val"].device, state_out,
                    use_cache, diff, cut, split=split if timestep is not None else None)
    facts = facts_of(gm)
    facts.structure_at_cut = s
    facts.cache_cut = cut
    bases = [len(b.parts) for b in seg.before_of.values()]
    counts = {"blocks_in_branch": n - fn - bn, "cond": 1, "state_tensors": len(state_in), "streams_cached": k,
              # leaving streams that are the join of entering ones (a hand-over inside the range), and
              # those with no entering stream of their shape, cached whole
              "streams_joined": sum(p > 1 for p in bases), "streams_cached_whole": sum(p == 0 for p in bases),
              "offload_loads_moved": relocated,
              # enable_separate_cfg=None: the state kept per CFG branch, told apart in the graph (0: one state)
              "cfg_branches": split.branches if split is not None and timestep is not None else 0}
    return PassResult(True, counts, f"blocks {fn}..{n - bn - 1} of {n} moved into a torch.cond branch "
                                    f"({len(seg.nodes)} nodes); {k} stream residual(s) cached; tag {tag}"
                                    + cfg_split_note(split, timestep is not None))


def cfg_split_note(split, has_timestep: bool) -> str:
    """What the report says about ``enable_separate_cfg=None`` (``split`` given)."""
    if split is None:
        return ""
    if not has_timestep:
        return ("; enable_separate_cfg=None: the graph has no timestep input to tell CFG branches apart, so every "
                "call shares one state (name each branch with cache_context(name), or set True)")
    return (f"; enable_separate_cfg=None: state kept per CFG branch ({split.branches}), a call at the previous "
            f"call's timestep and latents being the next branch of that step")


def image_stream_index(name: str, seg: MiddleSegment) -> Dict[str, int]:
    """``{"image_stream": i}``: the image stream's index among the streams leaving the range, for the rules that
    cache the whole range and keep a residual of the image stream only; refuses joined sequences."""
    odd = [o.name for o in seg.live_out if len(seg.before_of[o].parts) != 1]
    if odd:
        raise PassError(f"{name}: the streams {odd} leave the block range with a shape no entering stream "
                        f"has (a joined sequence); its residual is defined per stream here: use "
                        f"DBCache or FirstBlockCache for this model")
    image = [i for i, o in enumerate(seg.live_out) if seg.before_of[o].parts[0] is seg.image_at_cut]
    if len(image) != 1:
        raise PassError(f"{name}: the image stream '{seg.image_at_cut.name}' does not leave the block "
                        f"range as one stream (leaving: {[o.name for o in seg.live_out]})")
    return {"image_stream": image[0]}


class PeerCachePass(Pass):
    """What the passes of diffusers' block-range caches share: phase, facts, and a config given whole
    (ours, or diffusers' class of the same name) or as its fields. Subclasses set ``config_class`` (the name
    of the class in :mod:`dit_passes.cache.peer_configs`) and ``run``."""

    phase = Phase.CACHE
    reads = ("structure", "offload_loads", "parallel_group", "num_user_outputs")
    writes = ("num_user_outputs", "state_io", "inference_only", "structure_at_cut", "cache_cut")
    invalidates = ("structure",)
    config_class = ""

    def __init__(self, config=None, **fields: Any):
        from ..cache import peer_configs
        cls = getattr(peer_configs, self.config_class)
        if config is not None and fields:
            raise TypeError(f"pass either config={cls.__name__}(...) or its fields as keywords, not both")
        self.config = peer_configs.from_peer(config) if config is not None else cls(**fields)
        if not isinstance(self.config, cls):
            raise TypeError(f"{type(self).__name__}: config must be a {cls.__name__}, got {type(config).__name__}")

    def config_items(self) -> Dict[str, Any]:
        return {"tag": self.config.strify()}


def said_if_never_cached(name: str, config: Any, result: PassResult) -> PassResult:
    """``result`` with a warning (and its reason in the report) where ``config`` can cache no step at all
    (``DBCacheConfig.never_caches``): the branch is in the graph but the step never skips, which the user should
    hear of rather than measure."""
    reason = config.never_caches()
    if reason is None:
        return result
    warnings.warn(f"{name}: no step can be cached: {reason}", stacklevel=3)
    return dataclasses.replace(result, report=f"{result.report}; no step can be cached: {reason}")
