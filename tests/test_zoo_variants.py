"""The zoo's real-checkpoint variants (``family[tag]``, dit_passes/models/zoo_variants.py) and their coverage rows.

Every variant builds and runs eagerly (cheap); the capture column runs on the few whose graph differs most from
their base family's (a timestep per token, a second modulation for some tokens, block-causal masks, padded prompts
in the conditional row). The whole variant x pass matrix is ``dit-passes coverage --variants only``
(bench/results/coverage_variants.md), not CI.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import coverage
from dit_passes.models import zoo
from dit_passes.models.zoo_variants import VARIANTS

# the graph differs most from the base family's: one capture cell each (about 2 s)
CAPTURED = ("wan[ti2v]", "hunyuanvideo[i2v_tr]", "qwenimage[edit2511]", "skyreels_v2[df_causal]", "mochi[padded]")


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_every_variant_builds_runs_and_differs_from_its_base():
    assert zoo.VARIANTS_HERE and set(zoo.VARIANTS_HERE) <= set(zoo.ALL_VARIANTS)
    assert not set(zoo.ALL_VARIANTS) & set(zoo.ALL_FAMILIES)
    by_name = {v.name: v for v in VARIANTS}
    for name in zoo.VARIANTS_HERE:
        v = by_name[name]
        assert v.overrides or v.inputs is not None, f"{name} changes nothing of {v.family}"
        assert zoo.class_name_of(name) == zoo.class_name_of(v.family)
        config = zoo.config_for(name)
        assert all(config[k] == val for k, val in v.overrides.items()), name
        zm = zoo.build(name)
        kwargs = zm.make_inputs(seed=1)
        with torch.no_grad():
            out = zm.model(**kwargs)
        leaves = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
        assert leaves and all(torch.isfinite(t).all() for t in leaves), name
        if v.inputs is not None:  # the edited call is not the base family's call
            base = zoo.build(v.family).make_inputs(seed=1)
            assert set(kwargs) != set(base) or any(
                not isinstance(kwargs[k], torch.Tensor) or kwargs[k].shape != base[k].shape
                or not torch.equal(kwargs[k], base[k]) for k in kwargs), name


@pytest.mark.parametrize("variant", CAPTURED)
def test_capture_is_exact_on_variants(variant):
    cell = coverage.run_cell(variant, coverage._local_checks()["capture"], 120)
    assert cell.status == coverage.EXACT, cell


def test_select_rows_variants_option():
    rows = coverage.select_rows(["flux", "flux[schnell]", "wan"])
    assert [r.families for r in rows if r.families] == [("flux", "flux[schnell]"), ("wan",)]
    only = coverage.select_rows(None, "only")
    families = [f for r in only for f in r.families]
    assert families and all("[" in f for f in families) and set(families) == set(zoo.VARIANTS_HERE)
    none = coverage.select_rows(None, "none")
    assert not any("[" in f for r in none for f in r.families)
    assert {r.class_name for r in none} == {r.class_name for r in coverage.select_rows(None)}
    flux_row = next(r for r in coverage.select_rows(["FluxTransformer2DModel"]))
    assert flux_row.families[0] == "flux" and "flux[schnell]" in flux_row.families
    with pytest.raises(ValueError, match="variants must be"):
        coverage.select_rows(None, "some")


# ---------------------------------------------------------------------------- defects the variants found
def _mochi_padded_context_parallel(rank, world):
    """mochi[padded] (the prompt padded in the conditional row, as MochiPipeline pads to 256 tokens): Mochi's
    attention runs each sample on its valid text tokens and pads the output back, a reader the sequence plan
    gathers the attention's output for; the gather must read the distributed attention that replaced the SDPA
    (it read the erased SDPA: 'used before it has been defined')."""
    from dit_passes import compile_dit, passes
    zm = zoo.build("mochi[padded]", redraw_zeros=True)
    kw = zm.make_inputs(seed=1)
    with torch.no_grad():
        ref = zm.model(**kw)
    out = {}
    for name, make in (("ulysses", lambda: passes.Ulysses(size=world)), ("ring", lambda: passes.Ring(size=world))):
        compiled = compile_dit(zm.model, passes=[make()])
        with torch.no_grad():
            got = compiled(**kw)
        counts = compiled._current().manager.records[-1].result.counts
        out[name] = (coverage._max_rel(got, ref), counts.get("nonlocal_gathers", 0))
    return out


def test_context_parallel_gathers_a_replaced_attention_output():
    from dit_passes.testing import run_ranks
    for per_rank in run_ranks(_mochi_padded_context_parallel, 2, timeout=300):
        for name, (rel, gathers) in per_rank.items():
            assert rel <= coverage.TOLERANCE, (name, rel)
            assert gathers >= 1, (name, gathers)  # the padded attention output is gathered


# head counts that do not divide the 2 ranks (3 heads of 16): TensorParallel zero-pads them to whole heads per rank.
# CI runs the four whose padded heads meet the most (an RMSNorm over all heads, Wan; a RoPE table over H*D and a
# per-head cross-attention mask, LTX-Video; linear attention, Sana; a per-head LayerNorm with bias, CogVideoX);
# DIT_PASSES_FULL_SWEEP=1 runs all nine (bench/results/coverage_variants.md has the table).
HEADS3 = ("wan[heads3]", "ltxvideo[heads3]", "sana[heads3]", "cogvideox[heads3]")


def _heads3_tensor_parallel(rank, world, families):
    from dit_passes import compile_dit
    from dit_passes.passes.tensor_parallel import TensorParallel
    out = {}
    for family in families:
        zm = zoo.build(family, redraw_zeros=True)  # (zero-initialised weights would hide a wrong shard)
        kw = zm.make_inputs(seed=1)
        with torch.no_grad():
            ref = zm.model(**kw)
            compiled = compile_dit(zm.model, passes=[TensorParallel(size=world)])
            got = compiled(**kw)
        counts = [r for r in compiled._current().manager.records if r.name == "tensor_parallel"][0].result.counts
        out[family] = (coverage._max_rel(got, ref), counts)
    return out


def test_heads_the_ranks_do_not_divide_are_zero_padded_under_tensor_parallel():
    import os

    from dit_passes.testing import run_ranks
    families = [v.name for v in VARIANTS if v.tag == "heads3"] if os.environ.get("DIT_PASSES_FULL_SWEEP") == "1" \
        else list(HEADS3)
    for per_rank in run_ranks(_heads3_tensor_parallel, 2, families, timeout=300):
        for family, (rel, counts) in per_rank.items():
            assert rel <= coverage.TOLERANCE, (family, rel)
            # every q / k / v projection of the blocks padded 3 -> 4 heads, nothing gathered
            assert counts["padded_heads"] >= 6 and counts["padded_mlp"] == counts["fallback_all_gather"] == 0, \
                (family, counts)


# the families' own ops at small head counts (3 heads of 8, 1 head of 16) on 2 ranks: Lumina-Next's one kv head
# repeated to the q heads (replicated: sliced and zero-padded like q), Lumina 2's identity repeat of its kv heads,
# Z-Image's RoPE inside an autocast region (gathered with the padded heads dropped, as 2 heads are gathered there)
SMALL_HEADS = {"lumina_next": dict(hidden_size=24, num_attention_heads=3, num_layers=1),
               "lumina2": dict(hidden_size=24, num_attention_heads=3, num_kv_heads=3, axes_dim_rope=(2, 2, 4),
                               num_layers=1, num_refiner_layers=1),
               "zimage": dict(dim=16, n_heads=1, n_kv_heads=1, n_layers=1, n_refiner_layers=1)}
# the collectives of the zoo's own 2-head configs (divisible), one block each: one all-reduce per out / down
# projection, the modulation's all-gather, Lumina-Next's LayerNorm over all q heads (one all-gather per norm),
# Z-Image's q and k gathered before the RoPE's autocast region;
# (padded projections, all-reduce, norm all-gather, all-gather, gathered before an op without a rule)
SMALL_HEADS_COUNTS = {"lumina_next": (2, 2, 2, 1, 0), "lumina2": (3, 2, 0, 1, 0), "zimage": (3, 2, 0, 1, 2)}


def _small_heads_tensor_parallel(rank, world):
    from dit_passes import compile_dit
    from dit_passes.passes.tensor_parallel import TensorParallel
    out = {}
    for family, overrides in SMALL_HEADS.items():
        zm = zoo.build(family, redraw_zeros=True, **overrides)
        kw = zm.make_inputs(seed=1)
        with torch.no_grad():
            ref = zm.model(**kw)
            compiled = compile_dit(zm.model, passes=[TensorParallel(size=world)])
            got = compiled(**kw)
        record = [r for r in compiled._current().manager.records if r.name == "tensor_parallel"][0]
        ops = [str(n.target).split(".")[-2] for n in compiled._current().gm.graph.nodes
               if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait" not in str(n.target)]
        out[family] = (coverage._max_rel(got, ref), record.result.counts, sorted(ops))
    return out


def test_small_head_counts_are_zero_padded_under_tensor_parallel():
    """1 or 3 heads on 2 ranks pad as 38 heads on 4 do (SD3.5-large), through each family's own attention: exact,
    with exactly the collectives of the family's divisible head count."""
    from dit_passes.testing import run_ranks
    for per_rank in run_ranks(_small_heads_tensor_parallel, 2, timeout=300):
        for family, (rel, c, ops) in per_rank.items():
            assert rel <= 1e-5, (family, rel)
            got = (c["padded_heads"], c["all_reduce"], c["norm_all_gather"], c["all_gather"], c["fallback_all_gather"])
            assert got == SMALL_HEADS_COUNTS[family] and c["norm_all_reduce"] == 0, (family, c)
            gathers = c["norm_all_gather"] + c["all_gather"] + c["fallback_all_gather"]
            assert ops == sorted(["all_reduce"] * c["all_reduce"] + ["all_gather_into_tensor"] * gathers), (family, ops)


def test_a_crash_inside_a_pass_is_an_error_a_refusal_is_refused():
    """PassManager wraps what a pass raises: a refusal type (ShardingError, ...) as PassError (coverage: refused),
    anything else as PassCrashed (a PassError too; coverage: error)."""
    from dit_passes.infra.pass_base import Pass, PassCrashed, PassError
    from dit_passes.infra.phases import Phase
    from dit_passes.parallel.tp_weights import ShardingError

    class Raises(Pass):
        name = "raises"
        phase = Phase.ANALYSIS

        def __init__(self, exc):
            self.exc = exc

        def run(self, gm, ctx):
            raise self.exc

    def lower(exc):
        def check(zm, inputs, reference):
            coverage._compile(zm.model, lambda: [Raises(exc)], inputs)
        return check

    cell = coverage.run_cell("dit", lower(ShardingError("heads not divisible")), 60)
    assert cell.status == coverage.REFUSED and "heads not divisible" in cell.detail, cell
    cell = coverage.run_cell("dit", lower(RuntimeError("node used before it was defined")), 60)
    assert cell.status == coverage.ERROR and "PassCrashed" in cell.detail, cell
    assert issubclass(PassCrashed, PassError)
