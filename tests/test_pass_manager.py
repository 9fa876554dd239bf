"""PassManager: phase ordering, fact guards, verification naming the guilty pass, facts, explain() and dumps.

The graphs are captured from a small two-block toy transformer (capture only needs an nn.Module), so
every check runs on a real exported graph with real ``meta["val"]``.
"""
from __future__ import annotations

import operator
import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from dit_passes import compile_dit
from dit_passes.analysis.blocks import get_structure
from dit_passes.capture import capture
from dit_passes.infra.graph_utils import copy_meta, set_val
from dit_passes.infra.facts import FactAccessError, StateIO, facts_of
from dit_passes.infra.pass_base import Pass, PassContext, PassCrashed, PassError, PassResult
from dit_passes.infra.pass_manager import PassManager, order_passes
from dit_passes.infra.phases import Phase

aten = torch.ops.aten


class ToyBlock(torch.nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        return x + self.down(torch.relu(self.up(x)))


class ToyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([ToyBlock(), ToyBlock()])
        self.proj_out = torch.nn.Linear(16, 8)

    def forward(self, hidden_states):
        x = self.proj_in(hidden_states)
        for blk in self.blocks:
            x = blk(x)
        return (self.proj_out(x),)


@pytest.fixture
def toy():
    torch.manual_seed(0)
    model = ToyDiT().eval()
    x = torch.randn(1, 6, 8)
    return model, x


def captured_gm(model, x) -> fx.GraphModule:
    return capture(model, (), {"hidden_states": x}).gm


# -- toy passes -----------------------------------------------------------------------------------
class ReluToGelu(Pass):
    """Replaces every relu by gelu, propagating meta['val'] as the contract asks."""
    name = "relu_to_gelu"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        n_done = 0
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and n.target is aten.relu.default:
                with gm.graph.inserting_after(n):
                    new = gm.graph.call_function(aten.gelu.default, (n.args[0],))
                copy_meta(new, n)
                set_val(new)
                n.replace_all_uses_with(new)
                gm.graph.erase_node(n)
                n_done += 1
        return PassResult(n_done > 0, {"relu_replaced": n_done}, f"replaced {n_done} relu")


class CountLinears(Pass):
    name = "count_linears"
    phase = Phase.ANALYSIS

    def run(self, gm, ctx):
        k = sum(1 for n in gm.graph.nodes if n.target is aten.linear.default)
        return PassResult(False, {"linears": k}, "analysis only")


def named_pass(name, phase, reads=(), writes=(), log=None):
    cls = type(f"P_{name}", (Pass,), {"name": name, "phase": phase, "reads": tuple(reads), "writes": tuple(writes)})

    def run(self, gm, ctx):
        if log is not None:
            log.append(self.name)
        return PassResult(False)
    cls.run = run
    return cls()


# -- ordering --------------------------------------------------------------------------------------
def test_order_by_phase(toy):
    log = []
    a = named_pass("a", Phase.CACHE, log=log)
    b = named_pass("b", Phase.QUANTIZE, log=log)
    c = named_pass("c", Phase.SHARD_WEIGHTS, log=log)
    d = named_pass("d", Phase.QUANTIZE, log=log)
    mgr = PassManager([a, b, c, d])
    assert [p.name for p in mgr.passes] == ["c", "b", "d", "a"]  # one phase keeps the given order
    mgr.run(captured_gm(*toy))
    assert log == ["c", "b", "d", "a"]
    assert [p.name for p in order_passes([named_pass("x", Phase.CACHE), named_pass("y", Phase.CACHE)])] == ["x", "y"]


def test_real_passes_ordered(toy):
    mgr = PassManager([CountLinears(), ReluToGelu()])
    assert [p.name for p in mgr.passes] == ["relu_to_gelu", "count_linears"]


def test_library_passes_order_by_phase():
    from dit_passes import passes
    given = [passes.RegionalCompile(backend="eager"), passes.DBCache(), passes.AttentionBackend("math"),
             passes.LayerwiseOffload(), passes.Fp8Linear(), passes.Ulysses(2), passes.TensorParallel(2), passes.Cleanup()]
    assert [p.name for p in PassManager(given).passes] == [
        "cleanup", "tensor_parallel", "ulysses", "fp8_linear", "layerwise_offload", "attention_backend", "dbcache",
        "regional_compile"]


def test_unorderable_pipeline_is_reported():
    # two passes of one phase writing one fact: the message names both and the fact
    with pytest.raises(PassError, match=r"'a' and 'b' are both of phase QUANTIZE and both write graph fact\(s\) \['mesh'\]"):
        PassManager([named_pass("a", Phase.QUANTIZE, writes=("mesh",)), named_pass("b", Phase.QUANTIZE, writes=("mesh",)),
                     named_pass("free", Phase.CACHE)])
    # a read that only a later phase writes
    with pytest.raises(PassError, match=r"'early' \(phase QUANTIZE\) reads graph fact\(s\) \['cache_cut'\], which "
                                        r"pass 'late' writes in the later phase CACHE"):
        PassManager([named_pass("early", Phase.QUANTIZE, reads=("cache_cut",)),
                     named_pass("late", Phase.CACHE, writes=("cache_cut",))])
    from dit_passes import passes
    with pytest.raises(PassError, match="'ulysses' and 'ring' are both of phase SHARD_SEQUENCE"):
        PassManager([passes.Ulysses(2), passes.Ring(2)])


def test_pass_without_phase_is_rejected():
    class NoPhase(Pass):
        name = "no_phase"
    with pytest.raises(PassError, match="'no_phase' .*declares no phase.*SHARD_WEIGHTS"):
        PassManager([NoPhase()])


# -- verification names the pass that broke the graph ------------------------------------------------
class EraseUsedNode(Pass):
    name = "erase_used"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        lin = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
        gm.graph.erase_node(lin)  # still has users
        return PassResult(True)


class InsertWithoutVal(Pass):
    name = "no_val"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        n = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(aten.neg.default, (n,))
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        return PassResult(True)


class UseBeforeDefinition(Pass):
    name = "use_before_def"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if n.target is aten.linear.default]
        first, last = nodes[0], nodes[-1]
        first.args = (last,) + tuple(first.args[1:])  # reads a value defined later: not a DAG in order
        return PassResult(True)


class ReturnsNothing(Pass):
    name = "returns_nothing"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        return None


@pytest.mark.parametrize("bad,fragment", [
    (EraseUsedNode, "pass 'erase_used' failed"),
    (InsertWithoutVal, "after pass 'no_val', 1 node(s) lack meta['val']"),
    (UseBeforeDefinition, "graph is invalid after pass 'use_before_def'"),
    (ReturnsNothing, "pass 'returns_nothing' returned NoneType"),
])
def test_broken_graph_error_names_pass(toy, bad, fragment):
    gm = captured_gm(*toy)
    with pytest.raises(PassError) as err:
        PassManager([ReluToGelu(), bad()]).run(gm)  # the good pass first: the error blames the bad one
    assert fragment in str(err.value)


class ReluToGeluRecompiled(ReluToGelu):
    """ReluToGelu ending as the library's passes do: ``ctx.recompile_at_end(gm)``."""
    name = "relu_to_gelu_recompiled"

    def run(self, gm, ctx):
        result = super().run(gm, ctx)
        ctx.recompile_at_end(gm)
        return result


class _NoSource:
    """A constant argument whose repr is not Python: the graph lints, its generated code does not compile."""

    def __repr__(self):
        return "1 +* 2"


class UncompilableCode(Pass):
    name = "uncompilable_code"
    phase = Phase.QUANTIZE

    def run(self, gm, ctx):
        n = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(operator.add, (n, _NoSource()))
        copy_meta(new, n)
        new.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        ctx.recompile_at_end(gm)
        return PassResult(True)


def _count_recompiles(gm) -> list:
    """The calls of ``gm.recompile`` from now on (this instance only: the verification calls it by name)."""
    calls, real = [], gm.recompile

    def counted():
        calls.append(1)
        return real()
    gm.recompile = counted
    return calls


def test_recompile_at_end_is_done_once_by_the_manager(toy):
    model, x = toy
    gm = captured_gm(model, x)
    calls = _count_recompiles(gm)
    mgr = PassManager([ReluToGeluRecompiled()])
    mgr.run(gm)
    assert len(calls) == 1  # the pass's recompile, which the verification reuses instead of generating it again
    assert "gelu" in gm.code and "relu" not in gm.code and mgr.records[0].after == gm.code
    with torch.no_grad():
        torch.testing.assert_close(gm(x)[0], _reference_with_gelu(model, x), rtol=0, atol=1e-6)
    # a pass that leaves the recompile to the verification: one too, the same code
    plain = captured_gm(model, x)
    plain_calls = _count_recompiles(plain)
    PassManager([ReluToGelu()]).run(plain)
    assert len(plain_calls) == 1 and plain.code == gm.code
    # without verification the manager still does the pass's recompile
    unverified = captured_gm(model, x)
    PassManager([ReluToGeluRecompiled()], verify=False).run(unverified)
    assert unverified.code == gm.code


def test_recompile_at_end_outside_a_manager_recompiles_now(toy):
    model, x = toy
    gm = captured_gm(model, x)
    calls = _count_recompiles(gm)
    ctx = PassContext()
    ReluToGeluRecompiled().run(gm, ctx)
    assert len(calls) == 1 and "gelu" in gm.code
    other = captured_gm(model, x)  # a graph other than the one the manager runs the pass on: recompiled now too
    mgr_gm = captured_gm(model, x)
    ctx._deferred_gm = mgr_gm
    ctx.recompile_at_end(other)
    assert not ctx._recompile_asked


def test_deferred_recompile_failure_is_the_pass_crash(toy):
    # as when the pass recompiled itself: a crash of the pass (PassCrashed), not a verification error
    with pytest.raises(PassCrashed, match="pass 'uncompilable_code' failed: SyntaxError"):
        PassManager([UncompilableCode()]).run(captured_gm(*toy))
    with pytest.raises(SyntaxError):  # run directly: the recompile raises at once
        UncompilableCode().run(captured_gm(*toy), PassContext())


def test_non_pass_is_type_error(toy):
    with pytest.raises(TypeError, match="must hold dit_passes Pass instances, got function"):
        PassManager([lambda gm, ctx: None])
    with pytest.raises(TypeError, match="got type"):
        compile_dit(toy[0], passes=[ReluToGelu])  # the class, not an instance


# -- facts ----------------------------------------------------------------------------------------
class NeedsStructure(Pass):
    name = "needs_structure"
    phase = Phase.ANALYSIS
    reads = ("structure",)

    def __init__(self, seen):
        self.seen = seen

    def run(self, gm, ctx):
        structure = get_structure(gm)  # derived on first read, again after an invalidating pass
        self.seen.append(structure)
        return PassResult(False, {"blocks": len(structure.blocks)})


class InvalidatesStructure(ReluToGelu):
    name = "invalidating_rewrite"
    writes = ("structure_summary",)
    invalidates = ("structure",)

    def run(self, gm, ctx):
        result = super().run(gm, ctx)
        facts_of(gm).structure_summary = "rewritten"
        return result


def test_required_structure_is_derived_and_rederived_after_invalidation(toy):
    gm = captured_gm(*toy)
    seen = []
    a, b = NeedsStructure(seen), NeedsStructure(seen)
    b.name = "needs_structure_again"
    b.phase = Phase.ANALYSIS
    mgr = PassManager([a, InvalidatesStructure(), b])
    assert [p.name for p in mgr.passes] == ["invalidating_rewrite", "needs_structure", "needs_structure_again"]
    a.phase = Phase.CLEANUP  # run one reader before the rewrite
    mgr = PassManager([a, InvalidatesStructure(), b])
    mgr.run(gm)
    assert len(seen) == 2 and seen[0] is not seen[1]  # re-derived on the rewritten graph
    assert [blk.path for blk in seen[1].blocks] == ["blocks.0", "blocks.1"]
    gelus = [n for n in seen[1].blocks[0].nodes if n.target is aten.gelu.default]
    assert len(gelus) == 1  # the fresh structure holds the new node, not the erased relu
    assert facts_of(gm).structure_summary == "rewritten"


def test_unknown_fact_names_class_and_fact():
    with pytest.raises(TypeError, match=r"NeedsUnknownFact.reads names unknown graph fact\(s\) \['quant_tables'\]"):
        class NeedsUnknownFact(Pass):
            name = "needs_unknown"
            phase = Phase.ANALYSIS
            reads = ("quant_tables",)


class _Sneaky(Pass):
    phase = Phase.ANALYSIS

    def __init__(self, action):
        self.action = action

    def run(self, gm, ctx):
        self.action(facts_of(gm))
        return PassResult(False)


@pytest.mark.parametrize("action,err,fragment", [
    (lambda f: f.parallel_group, FactAccessError, "reads graph fact 'parallel_group' without declaring it"),
    (lambda f: setattr(f, "tp_size", 2), FactAccessError, "assigns graph fact 'tp_size' without declaring it"),
    (lambda f: f.offload_loads.update({"x": 0}), FactAccessError, "reads graph fact 'offload_loads'"),
])
def test_undeclared_fact_access_is_refused(toy, action, err, fragment):
    with pytest.raises(err, match=f"pass 'pass' {fragment}"):
        PassManager([_Sneaky(action)]).run(captured_gm(*toy))


def test_undeclared_fact_mutation_is_caught_after_the_pass(toy):
    class Appends(Pass):
        name = "appends"
        phase = Phase.CACHE
        reads = ("state_io",)

        def run(self, gm, ctx):
            facts_of(gm).state_io.append(StateIO(lambda rt: (), lambda rt, v: None, 0))
            return PassResult(False)
    with pytest.raises(PassError, match=r"'appends' changed graph fact\(s\) \['state_io'\] without declaring"):
        PassManager([Appends()]).run(captured_gm(*toy))


# -- results, explain, dumps, semantics ----------------------------------------------------------------
def test_rewrite_is_correct_and_explained(toy, tmp_path):
    model, x = toy
    compiled = compile_dit(model, passes=[CountLinears(), ReluToGelu()], dump_dir=str(tmp_path))
    with torch.no_grad():
        out = compiled(hidden_states=x)[0]
        ref = _reference_with_gelu(model, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert not any(n.target is aten.relu.default for n in compiled.graph.nodes)
    text = compiled.explain(print_output=False)
    for fragment in ("== cleanup()", "== relu_to_gelu()", "== count_linears()", "relu_replaced=2",
                     "linears=10", "analysis only", "(graph unchanged)", "--- before", "+++ after"):
        assert fragment in text, fragment
    assert any(line.strip().startswith("-") and "relu" in line for line in text.splitlines())
    assert any(line.strip().startswith("+") and "gelu" in line for line in text.splitlines())
    dumps = sorted(os.listdir(tmp_path / "g0"))
    assert dumps == ["00_captured.py", "01_cleanup.py", "02_relu_to_gelu.py", "03_count_linears.py"]
    assert "gelu" in (tmp_path / "g0" / "02_relu_to_gelu.py").read_text()


def _reference_with_gelu(model, x):
    h = model.proj_in(x)
    for blk in model.blocks:
        b, s, d = h.shape
        q, k, v = blk.qkv(h).view(b, s, 3, blk.heads, d // blk.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        h = h + blk.out(a)
        h = h + blk.down(F.gelu(blk.up(h)))
    return model.proj_out(h)


def test_explain_without_passes(toy):
    mgr = PassManager([])
    mgr.run(captured_gm(*toy))
    assert "no passes ran" in mgr.explain()


def test_toy_structure(toy):
    s = get_structure(captured_gm(*toy))
    assert [(bl.name, bl.count) for bl in s.block_lists] == [("blocks", 2)]
    assert s.num_streams == 1 and [a.block for a in s.attention] == [0, 1]
    roles = sorted(lin.role for lin in s.linears if lin.block == 0)
    assert roles == ["attn_out", "mlp_down", "mlp_up", "qkv"]
