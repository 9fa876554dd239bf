"""DBPrune: skip single blocks whose input barely changed since they last ran (cache-dit's dynamic block pruning).

Requires: ``structure``; block indices count over the whole block range as DBCache's do (Flux: the dual-
then the single-stream blocks, as the reference's default Flux adapter). Provides: one cache branch per
prunable block (facts ``state_io``, ``structure_at_cut``). Invalidates: ``structure`` (the prunable blocks move
into branch subgraphs). Same design as DBCache (decisions on the device, the state as graph inputs / outputs, per
cache context, no host read per step); the rule is :mod:`dit_passes.cache.prune`.

Before (Fn=1, Bn=0, three blocks)::

    h1 = <block 0>(h0, temb)
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)

After::

    h1 = <block 0>(h0, temb)                                         # Fn / Bn / non_prune_block_ids run
    begin = self.dbprune_begin(timestep, *scalars, *valid)           # step, generation, per-step diff list
    d1 = self.dbprune_b1_decide(h1, *begin_scalars, in1, in1_valid)  # prune1, diff1, *scalars'
    c1 = torch.ops.higher_order.cond(d1[0], self.dbprune_b1_cached, self.dbprune_b1_compute, (h1, temb, b1_res0))
    h2 = c1[0]                                                       # block 1, or h1 + its stored residual
    s1 = self.dbprune_b1_commit(d1[0], h1, step, c1[1], in1, in1_valid, b1_res0)  # input / residual stored if computed
    d2 = self.dbprune_b2_decide(h2, *d1_scalars, in2, in2_valid)
    ...                                                              # the same for block 2
    rec = self.dbprune_finish(prune1, prune2, diff1, diff2)          # this call's per-block record
    return (out, *scalars', *s1, *s2, *rec, use_cache, diff)

With a calibrator (TaylorSeer / FoCa / DMD, ``calibrator=``) a pruned block adds the forecast of its residuals from
its own calibrator state instead of stored ones, and the commit advances that state (:mod:`dit_passes.cache.prune`'s
docstring says what the reference does). As DBCache's, the forecast is formed in the cond's pruned arm only (the
arm's ``hit`` submodule, the program's ``block_hit``): a computed block does no forecast work. Block 1 then reads::

    d1 = self.dbprune_b1_decide(h1, *begin_scalars, in1, in1_valid)  # as without: the decision reads inputs only
    c1 = torch.ops.higher_order.cond(d1[0], self.dbprune_b1_cached, self.dbprune_b1_compute,
                                     (h1, temb, step, *b1_entries))  # b1_entries: its calibrator state, last step
    # dbprune_b1_cached: forecast = self.hit(step, *b1_entries); h2 = h1 + forecast[0]; returns (h2, forecast[0])
    s1 = self.dbprune_b1_commit(d1[0], h1, step, c1[1], in1, in1_valid, *b1_entries)  # calibrator advanced
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from .cache_branch import (_branch, _compute_arm_vals, _fake_call, _getitems, add_state_inputs, cfg_split_note,
                           dealias_live_in, finish_state_io, said_if_never_cached)
from .segments import cut_middle


class DBPrune(Pass):
    """Dynamic block pruning with cache-dit 1.5.3's ``DBPruneConfig`` (given whole or as its fields)."""

    name = "dbprune"
    phase = Phase.CACHE
    reads = ("structure", "offload_loads", "parallel_group", "num_user_outputs")
    writes = ("num_user_outputs", "state_io", "inference_only", "structure_at_cut")
    invalidates = ("structure",)

    def __init__(self, config=None, calibrator=None, **fields: Any):
        from ..cache.config import DBPruneConfig
        if config is not None and fields:
            raise TypeError("pass either config=DBPruneConfig(...) or its fields as keywords, not both")
        self.config = config if config is not None else DBPruneConfig(**fields)
        if not isinstance(self.config, DBPruneConfig):
            raise TypeError(f"DBPrune: config must be a DBPruneConfig, got {type(self.config).__name__}")
        from ..cache.prune import check_calibrator
        check_calibrator(calibrator)
        self.calibrator = calibrator

    def config_items(self) -> Dict[str, Any]:
        return {"tag": self.config.strify() + ("" if self.calibrator is None else f"_{self.calibrator.strify()}")}

    def _refuse(self, gm: fx.GraphModule, s) -> List[int]:
        facts = facts_of(gm)
        group = facts.parallel_group
        if group is not None and group.size() > 1:
            raise PassError(f"{self.name}: pruning under context / tensor parallelism is not implemented (the "
                            f"reference refuses it too); drop the parallel passes or use DBCache")
        if facts.offload_loads:
            raise PassError(f"{self.name}: layerwise offload with pruning is not implemented; use DBCache")
        blocks = self.config.prunable(len(s.blocks))
        if not blocks:
            raise PassError(f"{self.name}: no block can be pruned ({len(s.blocks)} blocks, Fn_compute_blocks="
                            f"{self.config.Fn_compute_blocks}, Bn_compute_blocks={self.config.Bn_compute_blocks}, "
                            f"non_prune_block_ids={self.config.non_prune_block_ids})")
        return blocks

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.prune import Begin, BlockCommit, BlockDecide, BlockHit, Finish, PruneStore, STEP_KEYS, \
            block_state_keys, build_prune_program
        from ..cache.branches import split_for
        from ..cache.state import SCALARS

        s = get_structure(gm)
        n = len(s.blocks)
        blocks = self._refuse(gm, s)
        segs = [dealias_live_in(gm, cut_middle(gm, s, j, n - j - 1)) for j in blocks]  # all cut before any rewrite
        g = gm.graph
        mode = detect_fake_mode([segs[0].image_at_cut.meta["val"]])
        timestep = next((p for p in g.nodes if p.op == "placeholder" and p.target == "timestep"), None)
        program = build_prune_program(self.config, total_blocks=n, blocks=blocks,
                                      inputs=[q.image_at_cut.meta["val"] for q in segs],
                                      residuals=[[o.meta["val"] for o in q.live_out] for q in segs],
                                      has_timestep=timestep is not None, calibrator=self.calibrator,
                                      image_streams=[_image_stream(q, self.calibrator) for q in segs])
        device = segs[0].image_at_cut.meta["val"].device
        state_in = dict(zip(program.names, add_state_inputs(gm, program, device, mode)))
        valid_names = [k for k in program.names if k.endswith("_valid")]

        def call(module_name: str, module: torch.nn.Module, args, names: List[str]) -> List[fx.Node]:
            gm.add_submodule(f"{self.name}_{module_name}", module)
            node = g.call_module(f"{self.name}_{module_name}", tuple(args))
            vals = _fake_call(module, args, mode)
            node.meta["val"] = vals
            return _getitems(g, node, vals, [f"{module_name}_{x}" for x in names])

        with g.inserting_before(segs[0].nodes[0]):
            t_arg = timestep if timestep is not None else segs[0].image_at_cut
            out = call("begin", Begin(program.begin_call), [t_arg, *(state_in[k] for k in SCALARS),
                                                            *(state_in[k] for k in valid_names)],
                       list(SCALARS) + list(STEP_KEYS) + valid_names)
        scalars = out[:len(SCALARS) + len(STEP_KEYS)]
        cur = dict(state_in, **dict(zip(valid_names, out[len(scalars):])))
        state_out: Dict[str, fx.Node] = {}
        replaced: Dict[fx.Node, fx.Node] = {}  # a rewritten block's leaving value -> its cond output
        prunes, diffs, moved = [], [], 0
        for i, (j, seg) in enumerate(zip(blocks, segs)):
            fix = lambda x: replaced.get(x, x)  # noqa: E731 - earlier rewrites replaced this block's inputs
            seg = dataclasses.replace(seg, live_in=[fix(a) for a in seg.live_in], image_at_cut=fix(seg.image_at_cut),
                                      before_of={o: dataclasses.replace(b, parts=tuple(fix(p) for p in b.parts))
                                                 for o, b in seg.before_of.items()})
            k = len(seg.live_out)
            keys = block_state_keys(program, i)  # in{j}, in{j}_valid, b{j}_* (its stream entries)
            h = seg.image_at_cut
            with g.inserting_before(seg.nodes[0]):
                decide_args = [h, *scalars, cur[keys[0]], cur[keys[1]]]  # the decision reads inputs, not forecasts
                d = call(f"b{j}_decide", BlockDecide(program.block_decide, i), decide_args,
                         ["prune", "diff"] + list(SCALARS) + list(STEP_KEYS))
                prune, scalars = d[0], d[2:]
                step = scalars[list(SCALARS).index("step")]
                hit_inputs = hit = None
                if program.predicts:  # the pruned arm forecasts from the step and the block's calibrator state
                    adds = [step, *(cur[x] for x in keys[2:])]
                    hit_inputs = [(x, a.meta["val"]) for x, a in zip(["step"] + keys[2:], adds)]
                    hit = BlockHit(program.block_hit, i)
                else:
                    adds = [cur[x] for x in program.residual_keys(i)]
                gm.add_submodule(f"{self.name}_b{j}_compute", _branch(gm, seg, k, cached=False, name=self.name,
                                                                      hit_inputs=hit_inputs))
                gm.add_submodule(f"{self.name}_b{j}_cached", _branch(gm, seg, k, cached=True, name=self.name,
                                                                     hit_inputs=hit_inputs, hit=hit))
                operands = tuple(seg.live_in) + tuple(adds)
                cond = g.call_function(torch.ops.higher_order.cond, (prune, g.get_attr(f"{self.name}_b{j}_cached"),
                                                                     g.get_attr(f"{self.name}_b{j}_compute"), operands))
                cond_vals = _compute_arm_vals(seg, mode)  # from the block's own metadata: no fake run of the block
                cond.meta["val"] = tuple(cond_vals)
                items = _getitems(g, cond, cond_vals, [f"b{j}_stream_{x}" for x in range(k)]
                                  + [f"b{j}_residual_{x}" for x in range(k)])
                new_state = call(f"b{j}_commit", BlockCommit(program.block_commit, i),
                                 [prune, h, step, *items[k:], *(cur[x] for x in keys)], [f"next_{x}" for x in keys])
            state_out.update(zip(keys, new_state))
            inside = set(seg.nodes)
            for o, new in zip(seg.live_out, items[:k]):
                o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
                replaced[o] = new
            for node in reversed(seg.nodes):
                g.erase_node(node)
            moved += len(seg.nodes)
            prunes.append(prune)
            diffs.append(d[1])
        with g.inserting_before(g.output_node()):
            rec = call("finish", Finish(program.finish_call), prunes + diffs, ["block_pruned", "block_diffs"])
        state_out.update(zip(SCALARS, scalars[:len(SCALARS)]))
        state_out.update(zip(("block_pruned", "block_diffs"), rec))
        last = dict(zip(SCALARS, scalars))
        split = split_for(self.config)
        finish_state_io(gm, ctx, self.name, lambda: PruneStore(self.config), program, device,
                        [state_out[x] for x in program.names], last["use_cache"], last["diff"],
                        split=split)
        facts_of(gm).structure_at_cut = s
        counts = {"blocks_prunable": len(blocks), "cond": len(blocks), "state_tensors": len(state_in),
                  "nodes_in_branches": moved,
                  "cfg_branches": split.branches if split is not None and timestep is not None else 0}
        return said_if_never_cached(self.name, self.config, PassResult(
            True, counts, f"blocks {blocks} of {n} each in its own torch.cond branch; tag {self.config.strify()}"
            + cfg_split_note(split, timestep is not None)))


def _image_stream(seg, calibrator) -> int:
    """The index of the image stream among the streams leaving one block (the calibrator's stream 0)."""
    image = [x for x, o in enumerate(seg.live_out) if seg.before_of[o].parts == (seg.image_at_cut,)]
    if len(image) == 1:
        return image[0]
    if calibrator is not None and calibrator.enable_calibrator != calibrator.enable_encoder_calibrator:
        raise PassError(f"dbprune: the image stream '{seg.image_at_cut.name}' does not leave the block as one stream "
                        f"(leaving: {[o.name for o in seg.live_out]}), so enable_calibrator and "
                        f"enable_encoder_calibrator cannot be told apart; set both alike")
    return 0


__all__ = ["DBPrune"]
