"""RegionalCompile: compile one block of each kind and run every repeated block through it.

Compiling a whole FLUX step with Inductor takes minutes (57 blocks, both arms of the cache branch), yet
the 19 double blocks are one program with different weights, and so are the 38 single blocks. This pass
outlines each block into a call of a shared *template*: the block's nodes copied into a GraphModule whose
weights are inputs instead of attributes, compiled once by ``torch.compile`` for all blocks of that
program. The graph around the blocks (embedders, the cache decision, the branch, the output projection)
stays eager: it is small, and ``torch.cond`` then runs as plain Python.

Use::

    compiled = compile_dit(model, passes=[passes.DBCache()], torch_compile={"regional": True})   # Inductor
    compiled = compile_dit(model, passes=[passes.DBCache(), passes.RegionalCompile(backend="aot_eager")])

Keyword arguments other than ``min_nodes`` (smallest region outlined, default 4) go to ``torch.compile``
(``fullgraph=True, dynamic=False`` unless given).

Requires: a ``compile_dit`` graph (weights as attributes, nodes carrying ``meta["dit_module_path"]``) and
block discovery's repeated lists (``structure.candidates``: the main stack and auxiliary lists such as
refiners). Runs last: after the parallel, quantization, offload and cache passes, on the top graph and
inside the cache branch's subgraphs. Guarantees: the same outputs (the template runs the block's own
nodes); one compilation per distinct block program (signature: the template's code, its inputs' shapes,
strides and dtypes, and the torch.compile arguments), shared by every graph of one CompiledDiT (the table
lives in ``compiled.runtime.state["regional_compile"]``); without grad, every template call runs below
autograd, as the arms of ``torch.cond`` do, so a block in the top graph and one in the branch share a
compilation (Dynamo guards on the inputs' dispatch keys).

Block boundaries are made layout-neutral so that first and middle blocks share a template: views at the end
of a block move out of its region and into the next one, ``cat`` of slices that tile a tensor folds to the
tensor (Flux's single blocks split the joint sequence at their end and join it at the next start), and a
``cat`` of the region's inputs only runs before the call. On tiny FLUX (2 + 2 blocks) and on FLUX.1-dev's
19 + 38: 2 templates. Blocks whose program really differs get their own template: SD3's last block
(``context_pre_only``), a dual-stream last block whose text output is dead (QwenImage), a first block
fed a non-contiguous or 5-D prologue output (PixArt, HunyuanVideo, CogVideoX), a quantized linear in some
blocks only. A flex attention (Kandinsky 6 SR, AnyFlow-FAR, Wan-Animate 2) runs eagerly between two regions of
its block: Dynamo cannot trace its exported form again.

Before (one Flux single block)::

    linear_3 = torch.ops.aten.linear.default(layer_norm_1, self.single_transformer_blocks.0.proj_mlp.weight, ...)
    gelu = torch.ops.aten.gelu.default(linear_3, approximate='tanh')
    ...                                                     # ~40 nodes
    add_9 = torch.ops.aten.add.Tensor(cat_3, mul_5)

After::

    region = self.region_single_transformer_blocks_0(temb, cat_2, rope_cos, rope_sin,
                                                     self.single_transformer_blocks.0.norm.linear.weight, ...)
    add_9 = region[0]

where every ``region_single_transformer_blocks_<i>`` holds the same compiled template (``counts``:
``regions`` outlined, ``templates`` used, ``templates_reused`` from an earlier graph, ``graphs`` visited,
``cats_folded``).

Not with ``mode="reduce-overhead"`` (or ``options={"triton.cudagraphs": True}``): CUDA graph trees copy
non-static inputs into static buffers, and the weights are inputs here, so every call would copy a block's
weights. Not under the torch.compile backend (``dit_passes.backend``): there the whole graph is compiled.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Collection, Dict, List, Set, Tuple

import torch
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase

def block_path(node: fx.Node, lists: Collection[str]) -> str:
    """The ``<list>.<index>`` prefix of the node's module path for the outermost repeated list in ``lists``
    ('' when none): ``single_transformer_blocks.3.attn.to_q`` -> ``single_transformer_blocks.3``."""
    parts = node.meta.get("dit_module_path", "").split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit() and ".".join(parts[:i]) in lists:
            return ".".join(parts[:i + 1])
    return ""


# Ops that only re-view their input. At a block boundary they make block i's outputs views of one tensor
# (Flux's single blocks end by slicing the joint sequence, the next block concatenates the slices), and a
# view's strides and offset would give that block a template of its own. So trailing views move out of a
# region and leading views into the next one: every middle block then takes and returns whole tensors.
_VIEW_OPS = {getattr(torch.ops.aten, name).default if "." not in name else
             getattr(getattr(torch.ops.aten, name.split(".")[0]), name.split(".")[1])
             for name in ("slice.Tensor", "select.int", "view.default", "_unsafe_view.default", "unsqueeze.default",
                          "squeeze.dim", "permute.default", "transpose.int", "t.default", "expand.default",
                          "alias.default", "narrow.default")}


# Higher-order ops Dynamo cannot trace again in their lowered (exported) form: a flex_attention node carries its
# score / mask graphs and their buffers as arguments, and Dynamo takes only the user-level call. Such a node ends
# its block's run (the block becomes two regions around it) and runs eagerly, as exported.
_NOT_RETRACEABLE = {torch.ops.higher_order.flex_attention}


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in _VIEW_OPS


_CAT = torch.ops.aten.cat.default
_SLICE = torch.ops.aten.slice.Tensor


def _fold_tiling_cats(graph: fx.Graph) -> int:
    """``cat([x[:, :t], x[:, t:]], 1)`` -> ``x`` when the slices tile a contiguous ``x`` in order (Flux's single
    blocks split the joint sequence at their end and join it again at the start of the next block). Exact: the
    same values, one copy less. Returns the number of cats folded; slices left unused are erased."""
    folded = 0
    for cat in [n for n in graph.nodes if n.op == "call_function" and n.target is _CAT]:
        parts = cat.args[0]
        if len(parts) < 2 or not all(isinstance(p, fx.Node) and p.target is _SLICE for p in parts):
            continue
        src = parts[0].args[0]
        if src.op == "placeholder" or any(u.op == "output" for u in cat.users):
            continue  # an output would alias an input or another output (torch.cond's arms forbid both)
        sv, cv = src.meta.get("val"), cat.meta.get("val")
        if not (isinstance(sv, torch.Tensor) and isinstance(cv, torch.Tensor)) or not sv.is_contiguous() or sv.ndim == 0:
            continue
        cdim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % sv.ndim
        pos, ok = 0, True
        for p in parts:
            a = list(p.args) + [None] * (5 - len(p.args))
            dim, start, end, step = a[1] if a[1] is not None else 0, a[2], a[3], a[4] if a[4] is not None else 1
            start = 0 if start is None else start
            end = sv.shape[cdim] if end is None else min(end, sv.shape[cdim])
            if (p.args[0] is not src or p.kwargs or dim % sv.ndim != cdim or step != 1 or start != pos
                    or not isinstance(end, int) or end < start):
                ok = False
                break
            pos = end
        if not ok or pos != sv.shape[cdim] or tuple(cv.shape) != tuple(sv.shape) or cv.dtype != sv.dtype:
            continue
        cat.replace_all_uses_with(src)
        graph.erase_node(cat)
        for p in set(parts):
            if not p.users:
                graph.erase_node(p)
        folded += 1
    return folded


def _regions(graph: fx.Graph, lists: Collection[str]) -> List[Tuple[str, List[fx.Node]]]:
    """Each block's nodes (graph order): runs of call_function nodes of one block path, trailing views
    moved out, concatenations of the region's inputs moved out, and leading views moved in (see ``_VIEW_OPS``)."""
    runs: List[Tuple[str, List[fx.Node]]] = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        p = block_path(n, lists) if n.target not in _NOT_RETRACEABLE else ""
        if p and runs and runs[-1][0] == p:
            runs[-1][1].append(n)
        else:
            runs.append((p, [n]))
    # Any other call (glue without a block path, a collective or an offload load placed between a block's
    # nodes, a flex attention) ends a run: a split block becomes two regions, still exact.
    runs = [(p, ns) for p, ns in runs if p]
    for _, ns in runs:  # trailing views: used only outside the region
        inside = set(ns)
        for n in reversed(list(ns)):
            if _is_view(n) and n.users and all(u not in inside for u in n.users):
                ns.remove(n)
                inside.discard(n)
    for _, ns in runs:  # a cat of values from outside the region joins streams at the boundary (Flux's first
        inside = set(ns)  # single block): run before the call, its input layouts do not enter the template
        for n in list(ns):
            if n.target is _CAT and not any(a in inside for a in n.all_input_nodes):
                ns.remove(n)
                inside.discard(n)
    owner_of = {n: i for i, (_, ns) in enumerate(runs) for n in ns}
    for i, (_, ns) in enumerate(runs):  # leading views: outside every region, used only by this one
        pulled: List[fx.Node] = []
        frontier = [a for n in ns for a in n.all_input_nodes]
        while frontier:
            a = frontier.pop()
            if (a in owner_of or a in pulled or not _is_view(a)
                    or any(owner_of.get(u) != i and u not in pulled for u in a.users)):
                continue
            pulled.append(a)
            owner_of[a] = i
            frontier.extend(a.all_input_nodes)
        if pulled:
            order = {n: k for k, n in enumerate(graph.nodes)}
            ns[:] = sorted(ns + pulled, key=order.__getitem__)
    return runs


class _Template:
    """A block's nodes as a GraphModule taking (*activations, *weights); weights are inputs, not attributes."""

    def __init__(self, nodes: List[fx.Node]):
        inside = set(nodes)
        self.acts: List[fx.Node] = []
        self.weights: List[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside:
                    continue
                bucket = self.weights if a.op == "get_attr" else self.acts
                if a not in bucket:
                    bucket.append(a)
        self.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        g = fx.Graph()
        env: Dict[fx.Node, fx.Node] = {}
        for i, a in enumerate(self.acts + self.weights):
            env[a] = g.placeholder(f"a{i}" if i < len(self.acts) else f"w{i - len(self.acts)}")
            env[a].meta["val"] = a.meta.get("val")
        for i, n in enumerate(nodes):
            env[n] = g.node_copy(n, lambda x: env[x])
            env[n].name = f"n{i}"  # canonical names: equal programs print equal code
        g.output(tuple(env[o] for o in self.outputs))
        self.graph = g
        self._gm: fx.GraphModule | None = None

    @property
    def gm(self) -> fx.GraphModule:
        """The template as a GraphModule, built when first asked for: only a template whose signature is new is
        compiled, and building one generates and compiles its code (57 times for FLUX.1-dev, 2 of them used)."""
        if self._gm is None:
            self._gm = fx.GraphModule(torch.nn.Module(), self.graph, class_name="BlockTemplate")
        return self._gm

    def code(self) -> str:
        """``self.gm.code`` without building the module: the code a GraphModule's recompile generates (it calls
        ``python_code(root_module="self")``; with the profiler-metadata option on, it also rewrites the code, so
        then the module is built)."""
        from torch.fx.experimental import _config as fx_config
        if self._gm is not None or getattr(fx_config, "enrich_profiler_metadata", False):
            return self.gm.code
        return self.graph.python_code(root_module="self").src

    def signature(self, root: torch.nn.Module) -> Tuple[Any, ...]:
        def meta(a: fx.Node):
            v = a.meta.get("val")
            if a.op == "get_attr":
                v = _attr(root, a.target)
            if not isinstance(v, torch.Tensor):
                return ("value", repr(v))
            return (tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type)
        return (self.code(), tuple(meta(a) for a in self.acts + self.weights))


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class TemplateTable(dict):
    """``{signature: (template id, compiled template)}`` shared by the graphs of one CompiledDiT
    (``runtime.state["regional_compile"]``), with the graphs using each: when the module evicts a graph
    (``Runtime.forget_graph``), the templates no remaining graph calls go with their compiled code, so a server
    seeing many resolutions keeps only the templates of the graphs it keeps. Ids are never reused."""

    def __init__(self) -> None:
        super().__init__()
        self.users: Dict[Tuple[Any, ...], Set[int]] = {}
        self.next_id = 0

    def add(self, sig: Tuple[Any, ...], compiled: Any) -> None:
        self[sig] = (self.next_id, compiled)
        self.next_id += 1

    def forget_graph(self, graph_id: int) -> None:
        for sig in [s for s, users in self.users.items() if graph_id in users]:
            self.users[sig].discard(graph_id)
            if not self.users[sig]:
                del self.users[sig], self[sig]


class CompiledRegion(torch.nn.Module):
    """One outlined block: calls the compiled template shared by every block of the same program."""

    def __init__(self, path: str, template_id: int, compiled: Any):
        super().__init__()
        self.path, self.template_id = path, template_id
        self._compiled = [compiled]  # a list: not registered as a submodule 57 times over

    def forward(self, *args: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            return self._compiled[0](*args)
        # torch.cond runs its arms below autograd (no Autograd key in the inputs' dispatch key set), the top graph
        # does not, and Dynamo guards on that key set: without grad, every call runs below autograd, so a template
        # shared by a top-graph block and a branch block compiles once
        with torch._C._AutoDispatchBelowAutograd():
            return self._compiled[0](*args)

    def extra_repr(self) -> str:
        return f"{self.path}, template {self.template_id}"


class RegionalCompile(Pass):
    """Outline every repeated block into a call of a compiled template shared by equal blocks."""

    name = "regional_compile"
    phase = Phase.COMPILE
    reads = ("structure", "structure_at_cut", "eager_only")
    writes = ("structure_at_cut",)
    invalidates = ("structure",)  # the blocks' nodes become calls: discovery no longer sees them

    def __init__(self, min_nodes: int = 4, **compile_kwargs: Any):
        unknown = sorted(set(compile_kwargs) - set(inspect.signature(torch.compile).parameters) - {"model"})
        if unknown or "model" in compile_kwargs:
            raise TypeError(f"RegionalCompile: {unknown or ['model']} are not torch.compile keyword arguments "
                            f"(give backend=, mode=, options=, dynamic=)")
        cudagraphs = (compile_kwargs.get("options") or {}).get("triton.cudagraphs")
        if compile_kwargs.get("mode") == "reduce-overhead" or cudagraphs:
            raise ValueError("RegionalCompile: mode='reduce-overhead' (CUDA graphs) would copy every block's "
                             "weights on each call (they are template inputs); use the default mode or "
                             "'max-autotune-no-cudagraphs', and for CUDA graphs compile_dit(..., torch_compile="
                             "{'regional': True, 'mode': 'reduce-overhead'}) (the whole step as one graph)")
        if "fullgraph" in compile_kwargs and not compile_kwargs["fullgraph"]:
            raise ValueError("RegionalCompile compiles whole blocks: fullgraph=False is not supported")
        self.min_nodes = int(min_nodes)
        self.compile_kwargs = {"fullgraph": True, "dynamic": False, **compile_kwargs}

    def config_items(self) -> Dict[str, Any]:
        return {k: v for k, v in self.compile_kwargs.items() if k not in ("fullgraph", "dynamic")}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.frontend != "export":
            raise PassError(f"regional_compile needs a compile_dit graph (weights as attributes); this graph comes "
                            f"from the {ctx.frontend!r} front end (torch.compile backend), which compiles the whole "
                            f"graph already: use compile_dit(model, passes=[..., passes.RegionalCompile()])")
        facts = facts_of(gm)
        if facts.eager_only:
            return PassResult(False, {"regions": 0}, f"not compiled: {facts.eager_only}")
        if facts.structure_at_cut is None:  # no cache branch took the blocks: they are calls afterwards
            facts.structure_at_cut = get_structure(gm)
        structure = facts.structure_at_cut
        # the repeated lists discovery saw (main stack and auxiliary ones such as refiners), each of one class
        lists = set(structure.candidates) | {bl.name for bl in structure.block_lists}
        # Templates are shared by every graph of one CompiledDiT (another signature with equal blocks reuses
        # them); the key holds the torch.compile arguments, so another configuration compiles its own.
        table = ctx.runtime.state.get(self.name)
        if not isinstance(table, TemplateTable):
            table = ctx.runtime.state[self.name] = TemplateTable()
        used: Dict[int, bool] = {}  # template id -> compiled for this graph (False: reused)
        counts = {"regions": 0, "templates": 0, "templates_reused": 0, "graphs": 0, "cats_folded": 0}
        for owner in self._graph_modules(gm):
            counts["graphs"] += 1
            counts["cats_folded"] += _fold_tiling_cats(owner.graph)
            for path, nodes in _regions(owner.graph, lists):
                if len(nodes) < self.min_nodes:
                    continue
                self._outline(owner, path, nodes, table, used, counts, ctx.graph_id)
            owner.graph.lint()
            ctx.recompile_at_end(owner)  # run by a pass manager, the top graph is recompiled once after the pass
        counts["templates"] = len(used)
        counts["templates_reused"] = sum(1 for new in used.values() if not new)
        if not counts["regions"]:
            return PassResult(bool(counts["cats_folded"]), counts,
                              "no block regions found (no node carries a block module path)")
        return PassResult(True, counts, f"{counts['regions']} blocks outlined into {len(used)} compiled template(s) "
                                        f"({counts['templates_reused']} from an earlier graph) across "
                                        f"{counts['graphs']} graph(s)")

    @staticmethod
    def _graph_modules(gm: fx.GraphModule) -> List[fx.GraphModule]:
        """The top graph and the subgraphs its control-flow nodes call (torch.cond branches), recursively; not
        the score / mask functions of an eager flex attention."""
        out, stack = [], [gm]
        while stack:
            g = stack.pop()
            out.append(g)
            for n in g.graph.nodes:
                if (n.op == "get_attr" and isinstance(_attr(g, n.target), fx.GraphModule)
                        and not all(u.target in _NOT_RETRACEABLE for u in n.users)):
                    stack.append(_attr(g, n.target))
        return out

    def _outline(self, owner: fx.GraphModule, path: str, nodes: List[fx.Node],
                 table: TemplateTable, used: Dict[int, bool], counts: Dict[str, int], graph_id: int) -> None:
        t = _Template(nodes)
        if not t.outputs or not all(isinstance(o.meta.get("val"), torch.Tensor) for o in t.outputs):
            counts["skipped"] = counts.get("skipped", 0) + 1  # a non-tensor crosses the boundary: stays eager
            return
        sig = (repr(sorted(self.compile_kwargs.items(), key=str)), t.signature(owner))
        if sig not in table:
            table.add(sig, torch.compile(t.gm, **self.compile_kwargs))
            used[table[sig][0]] = True
        table.users.setdefault(sig, set()).add(graph_id)
        tid, compiled = table[sig]
        used.setdefault(tid, False)
        name = "region_" + path.replace(".", "_")
        while hasattr(owner, name):
            name += "_"
        owner.add_module(name, CompiledRegion(path, tid, compiled))
        g = owner.graph
        # After the block's last node: every input is defined by then (each is read by a block node).
        with g.inserting_after(nodes[-1]):
            call = g.call_module(name, tuple(t.acts + t.weights))
        call.meta["dit_module_path"] = path
        anchor = call
        inside = set(nodes)
        for i, o in enumerate(t.outputs):
            with g.inserting_after(anchor):
                item = g.call_function(operator.getitem, (call, i))
            item.meta = {"val": o.meta.get("val"), "dit_module_path": path}
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            anchor = item
        # Nodes of other regions or of the outer graph that sit inside the block's span (views moved out of
        # it, views pulled into the next block) and read its outputs move after the call, in their order.
        moved = set(call.users)
        span = []
        cur = nodes[0]
        while cur is not call:
            span.append(cur)
            cur = cur.next
        for n in span:
            if n not in inside and any(a in moved for a in n.all_input_nodes):
                anchor.append(n)
                anchor = n
                moved.add(n)
        for n in reversed(nodes):
            if n.users:
                raise PassError(f"regional_compile: node '{n.name}' of {path} is still used after outlining")
            g.erase_node(n)
        counts["regions"] += 1
