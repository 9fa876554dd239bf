"""``dit-passes coverage`` (dit_passes/coverage.py) and the diffusers class listing (models/diffusers_zoo.py).

The local columns run on three cheap classes and must be exact; a class without a zoo config shows as
"no config"; no module of dit_passes outside the zoo names a diffusers transformer class.
"""
from __future__ import annotations

import json
import pathlib
import re

import diffusers
import pytest
import torch

from dit_passes import coverage
from dit_passes.infra.pass_base import Pass, PassError
from dit_passes.infra.phases import Phase
from dit_passes.models import zoo
from dit_passes.models.diffusers_zoo import EXCLUDED, ClassRow, coverage_rows, transformer_classes

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHEAP = ("dit", "cogview3plus", "wan")  # about 1 s a cell


def test_listing_comes_from_diffusers_and_covers_every_class_once():
    from diffusers.models.modeling_utils import ModelMixin
    classes = transformer_classes()
    assert classes and all(issubclass(c, ModelMixin) for c in classes.values())
    rows = coverage_rows()
    names = [r.class_name for r in rows]
    assert len(names) == len(set(names))
    assert set(classes) <= set(names)
    # every exclusion names a class this diffusers has or had; every zoo family maps to its class's row
    assert set(EXCLUDED) & set(classes), "the exclusion table names none of this diffusers' classes"
    by_family = {f: r.class_name for r in rows for f in r.families}
    assert set(by_family) == set(zoo.ALL_FAMILIES) | set(zoo.ALL_VARIANTS)
    assert all(by_family[f] == zoo.class_name_of(f) for f in by_family)
    assert not any(r.families and r.excluded for r in rows), "a zoo family builds an excluded class"
    # the curated test zoo plus the coverage-only configs exist in this diffusers
    for f in zoo.FAMILIES + zoo.MORE_FAMILIES_HERE:
        assert hasattr(diffusers, zoo.class_name_of(f)), f


def test_no_diffusers_class_named_outside_the_zoo():
    names = set(transformer_classes())
    pattern = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b")
    hits = []
    for path in sorted((ROOT / "dit_passes").rglob("*.py")):
        if path.relative_to(ROOT / "dit_passes").parts[0] == "models":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(1)}")
    assert not hits, "diffusers transformer classes named outside dit_passes/models:\n" + "\n".join(hits)


@pytest.fixture(scope="module")
def local_matrix():
    torch.set_num_threads(1)
    rows = coverage.select_rows(list(CHEAP)) + [ClassRow("NotAZooClass2DModel", "tests", ())]
    return coverage.build_matrix(rows, coverage.LOCAL_COLUMNS, parallel=False, timeout=60)


def test_local_columns_exact_on_cheap_classes(local_matrix):
    rows = {r["family"]: r for r in local_matrix["rows"]}
    assert set(CHEAP) <= set(rows)
    for family in CHEAP:
        for column in coverage.LOCAL_COLUMNS:
            cell = rows[family]["cells"][column]
            # a pattern pass may find none of its pattern (nothing to do, with its reason); a quantization or cache
            # column always has work on these classes
            allowed = ("exact",) if column in coverage.QUANT_COLUMNS + coverage.CACHE_COLUMNS else \
                ("exact", coverage.NOTHING)
            assert cell["status"] in allowed, (family, column, cell)
            assert cell["status"] != coverage.NOTHING or cell["detail"], (family, column, cell)
    assert local_matrix["summary"]["capture"]["exact"] == len(CHEAP)
    assert local_matrix["columns"] == list(coverage.LOCAL_COLUMNS)


def test_epilogues_detail_counts_the_rewritten_linears(local_matrix):
    """The epilogues cell says how many linears each pass rewrote: the counts agree with the lowered graph
    (one linear_gelu op per fused pair, one concatenation gone per split linear)."""
    from dit_passes import compile_dit, passes
    rows = {r["family"]: r for r in local_matrix["rows"]}
    rewritten = 0
    for family in CHEAP:
        detail = rows[family]["cells"]["epilogues"]["detail"]
        m = re.fullmatch(r"rel \S+, split (\d+), gelu (\d+)", detail)
        assert m, detail
        zm = zoo.build(family, redraw_zeros=True)
        inputs = zm.make_inputs(seed=1)

        def count(passes_, target):
            compiled = compile_dit(zm.model, passes=passes_)
            compiled.lower(**inputs)
            return sum(n.target is target for n in compiled.graph.nodes)
        cat, gelu = torch.ops.aten.cat.default, torch.ops.dit_passes.linear_gelu.default
        assert int(m.group(1)) == count([], cat) - count([passes.SplitConcatLinear()], cat), (family, detail)
        assert int(m.group(2)) == count([passes.FuseLinearGelu()], gelu), (family, detail)
        rewritten += int(m.group(1)) + int(m.group(2))
    assert rewritten, "no cheap class has a pattern either pass rewrites: the check sees nothing"


def test_fuse_fp8_attention_details_count_what_the_passes_rewrote(local_matrix):
    """The fuse / fp8 / attention cells say how many groups, linears and attentions their pass rewrote: the counts
    agree with the lowered graphs (fewer linears by at least one per fused group, by one per quantized linear; one
    aten.scaled_dot_product_attention per pinned attention before the pass)."""
    from dit_passes import compile_dit, passes
    rows = {r["family"]: r for r in local_matrix["rows"]}
    linear, sdpa = torch.ops.aten.linear.default, torch.ops.aten.scaled_dot_product_attention.default
    groups_seen = 0
    for family in CHEAP:
        cells = rows[family]["cells"]
        groups = int(re.fullmatch(r"rel \S+, groups (\d+)", cells["fuse"]["detail"]).group(1))
        quantized = int(re.fullmatch(r"rel \S+ \(weights only \S+\), linears (\d+)", cells["fp8"]["detail"]).group(1))
        pinned = int(re.fullmatch(r"rel \S+, attention (\d+)", cells["attention"]["detail"]).group(1))

        def count(passes_, target):  # a fresh model each time: the passes release the weights they rewrite
            zm = zoo.build(family, redraw_zeros=True)
            compiled = compile_dit(zm.model, passes=passes_)
            compiled.lower(**zm.make_inputs(seed=1))
            return sum(n.target is target for n in compiled.graph.nodes)
        linears, attentions = count([], linear), count([], sdpa)
        assert linears and attentions, family
        assert groups <= linears - count([passes.FuseSiblingLinears()], linear), (family, groups)
        # the block linears but routers; embedders and final projections stay in fp32 (the pass's selection)
        assert 0 < quantized == linears - count([passes.Fp8Linear()], linear), (family, quantized)
        assert pinned == attentions, (family, pinned)
        groups_seen += groups
    assert groups_seen, "no cheap class has sibling linears: the fuse column fuses nothing here"


@pytest.mark.parametrize("family", ["flux", "cosmos"])
def test_norm_rope_detail_counts_the_fused_ropes(family):
    """The norm_rope cell says how many ropes FuseNormRope fused: one dit_passes::rms_norm_rope op each in the
    lowered graph (FLUX: interleaved, aten.rms_norm; Cosmos: half-split, diffusers' RMSNorm in ATen ops)."""
    from dit_passes import compile_dit, passes
    from dit_passes.coverage_cells import _local_checks
    torch.set_num_threads(1)
    cell = coverage.run_cell(family, _local_checks()["norm_rope"], 60)
    assert cell.status == "exact", cell
    ropes = int(re.fullmatch(r"rel \S+, ropes (\d+)", cell.detail).group(1))
    zm = zoo.build(family, redraw_zeros=True)
    compiled = compile_dit(zm.model, passes=[passes.FuseNormRope()])
    compiled.lower(**zm.make_inputs(seed=1))
    assert 0 < ropes == sum(n.target is torch.ops.dit_passes.rms_norm_rope.default for n in compiled.graph.nodes)


def _broken_fp8(how: str):
    """Stands in for a wrong fp8 rewrite: Fp8Linear with its square weights transposed (the others as they are)
    or its bias dropped."""
    from dit_passes import passes

    class Broken(passes.Fp8Linear):
        def prepare(self, path, weight, bias, absmax, kind):
            if how == "transposed":
                weight = weight.t().contiguous() if weight.shape[0] == weight.shape[1] else weight
            else:
                bias = None if bias is None else torch.zeros_like(bias)
            return super().prepare(path, weight, bias, absmax, kind)
    return Broken()


@pytest.mark.parametrize("how", ["transposed", "bias"])
def test_fp8_bound_catches_a_wrong_rewrite(how):
    """The fp8 bound (FP8_RATIO x the error of e4m3 weights alone) is loose enough for e4m3's rounding (the fp8
    column is exact on the cheap classes) and tight enough that a transposed weight or a missing bias is an error
    on each of them."""
    check = coverage._cells._check_plain(lambda: [_broken_fp8(how)], coverage._cells._fp8_bound)
    for family in CHEAP:
        cell = coverage.run_cell(family, check, timeout=60)
        assert cell.status == "error" and "max relative error" in cell.detail, (family, how, cell)


def test_class_without_config_shows_no_config(local_matrix, tmp_path):
    row = next(r for r in local_matrix["rows"] if r["class"] == "NotAZooClass2DModel")
    assert row["family"] is None
    assert {c["status"] for c in row["cells"].values()} == {"no config"}
    assert set(row["cells"]) == set(coverage.LOCAL_COLUMNS)
    assert local_matrix["summary"]["dbcache"]["no config"] == 1
    md = coverage.to_markdown(local_matrix, "dit-passes coverage --test")
    assert "| NotAZooClass2DModel | - | no config |" in md
    assert "## Excluded classes" in md and "PriorTransformer" in md
    text = coverage.to_text(local_matrix)
    assert "NotAZooClass2DModel (no config)" in text
    json.dumps(local_matrix)  # the JSON file is the same dict


class _Refuses(Pass):
    """Stands in for a pass whose analysis cannot prove its rewrite: refuses before anything runs."""
    name = "refuses"
    phase = Phase.ANALYSIS

    def run(self, gm, ctx):
        raise PassError("refuses: cannot prove the rewrite")


class _Slow(Pass):
    """Runs ``work`` while lowering (a stand-in for a capture or pass that outlasts the cell's deadline)."""
    name = "slow"
    phase = Phase.ANALYSIS

    def __init__(self, work):
        self.work = work

    def run(self, gm, ctx):
        self.work()


def test_cells_classify_refusals_and_errors():
    def refuse(zm, inputs, reference):
        coverage._compile(zm.model, lambda: [_Refuses()], inputs)

    def crash(zm, inputs, reference):
        raise IndexError("boom")

    def wrong(zm, inputs, reference):
        coverage._within(coverage._max_rel(reference[0] * 1.1, reference[0]), coverage.TOLERANCE, "x")

    cell = coverage.run_cell("dit", refuse, 30)
    assert cell.status == "refused" and "cannot prove the rewrite" in cell.detail, cell
    cell = coverage.run_cell("dit", crash, 30)
    assert (cell.status, cell.detail) == ("error", "IndexError: boom")
    cell = coverage.run_cell("dit", wrong, 30)
    assert cell.status == "error" and "max relative error" in cell.detail


def test_cell_timeout_is_an_error():
    import time

    from dit_passes.capture import CaptureError

    def slow(zm, inputs, reference):
        time.sleep(5)

    cell = coverage.run_cell("dit", slow, 0.5)
    assert cell.status == "error" and "CellTimeout" in cell.detail and cell.seconds < 4

    def slow_capture():  # the deadline inside a capture: the library wraps it in a refusal type
        try:
            time.sleep(5)
        except coverage.CellTimeout as e:
            raise CaptureError("could not functionalise the graph") from e

    def lowering_times_out(zm, inputs, reference):
        coverage._compile(zm.model, lambda: [_Slow(slow_capture)], inputs)

    cell = coverage.run_cell("dit", lowering_times_out, 0.5)
    assert cell.status == "error" and cell.seconds < 4, cell

    def retries_on_exception(zm, inputs, reference):  # as capture retries a failed export: the deadline still ends it
        for _ in range(3):
            try:
                time.sleep(2)
            except Exception:  # noqa: BLE001
                pass
        return "ran on"

    cell = coverage.run_cell("dit", retries_on_exception, 0.5)
    assert cell.status == "error" and "CellTimeout" in cell.detail and cell.seconds < 4, cell


def test_cli_arguments(capsys):
    from dit_passes.cli import main
    assert main(["coverage", "--columns", "capture,nope"]) == 2
    assert "unknown column(s) ['nope']" in capsys.readouterr().err
    assert main(["coverage", "--families", "not_a_family"]) == 2
    assert "unknown families / classes ['not_a_family']" in capsys.readouterr().err


def test_update_replaces_only_the_rerun_cells():
    """``--update``: re-run cells take the place of the same cells (a former "no config" class gets its family's
    row), the others stay, counts and commands follow; another batch refuses to merge."""
    def matrix(rows, command, columns=("capture", "dbcache")):
        return {"diffusers": "d", "torch": "t", "world": 1, "batch": 1, "tolerance": 1e-5, "svdquant_bound": 0.25,
                "columns": list(columns), "seconds": 10.0, "command": command,
                "rows": [{"class": c, "family": f, "cells": {col: {"status": st, "detail": "", "seconds": 1.0}
                                                             for col, st in cells.items()}} for c, f, cells in rows],
                "summary": {}, "excluded": {}, "zoo_families": []}

    base = matrix([("A", "a", {"capture": "error", "dbcache": "exact"}),
                   ("B", "b", {"capture": "exact", "dbcache": "exact"}),
                   ("C", None, {"capture": "no config", "dbcache": "no config"})], "first")
    new = matrix([("A", "a", {"capture": "exact"}), ("C", "c", {"capture": "refused"})], "second", columns=("capture",))
    merged = coverage.merge_rows(base, new)
    got = [(r["class"], r["family"], {c: x["status"] for c, x in r["cells"].items()}) for r in merged["rows"]]
    assert got == [("A", "a", {"capture": "exact", "dbcache": "exact"}),
                   ("B", "b", {"capture": "exact", "dbcache": "exact"}), ("C", "c", {"capture": "refused"})]
    assert merged["summary"]["capture"] == {"exact": 2, "nothing to do": 0, "refused": 1, "error": 0, "no config": 0}
    assert merged["commands"] == ["first", "second"] and merged["seconds"] == 20.0
    assert "then the rows of `second`" in coverage.to_markdown(merged)
    with pytest.raises(ValueError, match="different batch"):
        coverage.merge_rows(base, dict(new, batch=2))


def test_update_adds_a_column():
    """An update may add a column the earlier matrix lacks: each row gets its cell from the update (after the
    earlier columns), a row the update did not run has none; a local-only update merges into a matrix made on
    ranks (the rank count is no setting of its cells), a parallel one on another rank count refuses."""
    def cells(**kw):
        return {c: {"status": st, "detail": "", "seconds": 1.0} for c, st in kw.items()}

    base = {"diffusers": "d", "torch": "t", "world": 2, "batch": 1, "tolerance": 1e-5, "svdquant_bound": 0.25,
            "columns": ["capture", "tp"], "seconds": 10.0, "command": "first", "excluded": {}, "zoo_families": [],
            "rows": [{"class": "A", "family": "a", "cells": cells(capture="exact", tp="exact")},
                     {"class": "B", "family": "b", "cells": cells(capture="exact", tp="refused")}]}
    new = dict(base, world=1, columns=["epilogues"], seconds=5.0, command="second",
               rows=[{"class": "A", "family": "a", "cells": cells(epilogues="error")}])
    merged = coverage.merge_rows(base, new)
    assert merged["columns"] == ["capture", "tp", "epilogues"] and merged["world"] == 2
    assert merged["torch"] == "t" and coverage.merge_rows(base, dict(new, torch="u"))["torch"] == "t, then u"
    assert [sorted(r["cells"]) for r in merged["rows"]] == [["capture", "epilogues", "tp"], ["capture", "tp"]]
    assert merged["rows"][0]["cells"]["epilogues"]["status"] == "error"
    assert merged["summary"]["epilogues"] == {"exact": 0, "nothing to do": 0, "refused": 0, "error": 1, "no config": 0}
    assert merged["summary"]["tp"] == {"exact": 1, "nothing to do": 0, "refused": 1, "error": 0, "no config": 0}
    md = coverage.to_markdown(merged)
    assert "| A | a | exact | exact | **error** [1] |" in md and "| B | b | exact | refused [2] |  |" in md
    assert "B (no config)" not in coverage.to_text(merged)
    # a column's bounds: taken from the update where the base lacks the column, else they must agree
    fp8 = dict(new, columns=["fp8"], fp8_ratio=3.5, fp8_bound=0.1,
               rows=[{"class": "A", "family": "a", "cells": cells(fp8="exact")}])
    with_fp8 = coverage.merge_rows(base, fp8)
    assert (with_fp8["fp8_ratio"], with_fp8["fp8_bound"]) == (3.5, 0.1)
    assert "<= 3.5 x the error of the same linears with e4m3 weights alone" in coverage.to_markdown(with_fp8)
    with pytest.raises(ValueError, match="different fp8_ratio"):
        coverage.merge_rows(with_fp8, dict(fp8, fp8_ratio=10.0))
    with pytest.raises(ValueError, match="different world"):
        coverage.merge_rows(base, dict(new, world=4, columns=["ulysses"],
                                       rows=[{"class": "A", "family": "a", "cells": cells(ulysses="exact")}]))


def test_dbcache_cuts_across_a_dual_to_single_hand_over():
    """Flux2 joins text and image before its single blocks: with Fn=1 the join is inside the cached range,
    and the joint stream leaving it is cached against the concatenation of the two streams entering it."""
    from dit_passes import compile_dit, passes
    zm = zoo.build("flux2")
    kw = zm.make_inputs()
    # one state for both calls: under the default (None) two calls with the same timestep and latents are the CFG
    # branches of one step, each computed once
    compiled = compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=1, residual_diff_threshold=1.0,
                                                            max_warmup_steps=1,
                                                            enable_separate_cfg=False)])
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        computed, cached = compiled(**kw)[0], compiled(**kw)[0]
    counts = compiled._current().manager.records[-1].result.counts
    assert (counts["streams_cached"], counts["streams_joined"], counts["streams_cached_whole"]) == (1, 1, 0)
    assert compiled.report("dbcache").last_generation()["step_cached"] == [False, True]
    assert coverage._max_rel(computed, ref) <= coverage.TOLERANCE
    assert coverage._max_rel(cached, computed) <= coverage.TOLERANCE


class _PackedBlock(torch.nn.Module):
    """Two residual streams of a sequence without a batch axis, ``(tokens, channels)``, that see each other."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.und, self.gen = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, und, gen):
        joint = torch.cat([und, gen]).mean(0, keepdim=True)
        return und + self.und(und + joint).tanh(), gen + self.gen(gen + joint).tanh()


class _Packed(torch.nn.Module):
    """Cosmos 3's layout: tokens written into a joint (tokens, channels) buffer, split into two streams."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList([_PackedBlock() for _ in range(3)])

    def forward(self, tokens, order):
        hidden = tokens.new_zeros(tokens.shape[0], 8)
        hidden[order] = self.proj(tokens)  # in place: capture functionalises it, the split moves into block 0
        und, gen = hidden[:3], hidden[3:]
        for layer in self.layers:
            und, gen = layer(und, gen)
        return (torch.cat([und, gen]),)


def test_dbcache_on_streams_without_a_batch_axis():
    """Block 0's streams are slices of a (tokens, channels) buffer: the cache takes them as its residual streams
    (the image stream the larger one) and caches both leaving streams."""
    from dit_passes import compile_dit, passes
    torch.manual_seed(0)
    model = _Packed().eval()
    kw = {"tokens": torch.randn(10, 4), "order": torch.randperm(10)}
    compiled = compile_dit(model, passes=[passes.DBCache(Fn_compute_blocks=1, residual_diff_threshold=1.0,
                                                         max_warmup_steps=1)])
    with torch.no_grad():
        ref = model(**kw)[0]
        computed, cached = compiled(**kw)[0], compiled(**kw)[0]
    counts = compiled._current().manager.records[-1].result.counts
    assert counts["streams_cached"] == 2 and counts["blocks_in_branch"] == 2
    assert compiled.report("dbcache").last_generation()["step_cached"] == [False, True]
    assert coverage._max_rel(computed, ref) <= coverage.TOLERANCE
    assert coverage._max_rel(cached, computed) <= coverage.TOLERANCE


def _zero_parameters(model) -> list:
    return [n for n, p in model.named_parameters() if p.is_floating_point() and p.numel() and not p.any()]


def test_coverage_builds_keep_no_all_zero_parameter():
    """diffusers zero-initialises gates and modulation projections (PRX's modulation.lin, Lumina-Next's gate,
    Kandinsky 5's modulation out_layer): the coverage cells build every family with them redrawn, the same on
    every build (each rank builds its own copy)."""
    torch.set_num_threads(1)

    def no_zeros(zm, inputs, reference):
        zeros = _zero_parameters(zm.model)
        assert not zeros, zeros
        assert all(torch.isfinite(t).all() for t in coverage._leaves(reference)), "non-finite eager output"
        return "ok"

    families = zoo.FAMILIES + zoo.MORE_FAMILIES_HERE
    cells = {f: coverage.run_cell(f, no_zeros, 120) for f in families}
    bad = {f: c.detail for f, c in cells.items() if c.status != "exact"}
    assert not bad, bad
    # the redraw is what removed them: the plain zoo keeps diffusers' zero gates, and two builds agree
    assert "blocks.0.modulation.lin.weight" in _zero_parameters(zoo.build("prx").model)
    a, b = (dict(zoo.build("prx", redraw_zeros=True).model.named_parameters()) for _ in range(2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a["blocks.0.modulation.lin.weight"].abs().max() > 0


def test_cells_record_status_counts_and_versions(local_matrix):
    """Each cell keeps its measured error and its pass's own counts; a pattern pass that found none of its pattern
    is "nothing to do" with the pass's reason (DiT has no RMSNorm + rope: the lowered graph holds no fused op),
    counted apart and listed with its reason; the cache cells count the calls they served; the matrix names the
    commit and versions it ran with."""
    import subprocess

    import diffusers

    from dit_passes import compile_dit, passes
    rows = {r["family"]: r for r in local_matrix["rows"]}
    cell = rows["dit"]["cells"]["norm_rope"]
    assert cell["status"] == coverage.NOTHING and "rotary" in cell["detail"], cell
    assert cell["changed"]["fused"] == 0 and cell["error"] <= coverage.TOLERANCE
    zm = zoo.build("dit", redraw_zeros=True)
    compiled = compile_dit(zm.model, passes=[passes.FuseNormRope()])
    compiled.lower(**zm.make_inputs(seed=1))
    assert not any(n.target is torch.ops.dit_passes.rms_norm_rope.default for n in compiled.graph.nodes)
    assert local_matrix["summary"]["norm_rope"][coverage.NOTHING] >= 1
    md = coverage.to_markdown(local_matrix)
    assert "| nothing to do |" in md and "dit / norm_rope: nothing to do: " in md
    for family in CHEAP:
        cells = rows[family]["cells"]
        # the cache columns: several steps of the loop cached, at least one block in the branch
        assert cells["dbcache"]["cached_steps"] >= 2 and cells["taylorseer"]["cached_steps"] >= 2, family
        assert cells["dbcache"]["changed"]["blocks_in_branch"] >= 1, family
        # the fp8 cell's counts are its detail's (checked against the graph above)
        assert f"linears {cells['fp8']['changed']['replaced']}" in cells["fp8"]["detail"], family
        for column in coverage.LOCAL_COLUMNS:
            assert cells[column]["error"] is not None and cells[column]["error"] <= 0.25, (family, column)
    root = ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = "unknown"
    assert local_matrix["commit"].split("+")[0] == head
    assert (local_matrix["torch"], local_matrix["diffusers"]) == (torch.__version__, diffusers.__version__)


def test_quant_column_builds_widths_its_groups_fit():
    """SANA's blocks are 32 wide in the zoo: SVDQuant's int4 groups of 64 fit none of its linears. The svdquant
    column builds it with twice the heads (the head width kept) and quantizes every block linear (no K left), as
    the lowered graph shows; at the zoo's widths the same column is an error, not an exact cell with nothing
    quantized."""
    from dit_passes import compile_dit, passes
    torch.set_num_threads(1)
    check = coverage._local_checks()["svdquant"]
    assert check.k_multiple == 64
    widths = zoo.group_widths("sana", 64)
    assert widths == {"num_attention_heads": 2 * zoo.config_for("sana")["num_attention_heads"]}
    cell = coverage.run_cell("sana", check, 60)
    assert cell.status == "exact", cell
    assert cell.changed["replaced"] > 0 and cell.changed["skipped_k"] == 0, cell.changed
    zm = zoo.build("sana", redraw_zeros=True, **widths)
    linear = torch.ops.aten.linear.default
    before = compile_dit(zm.model, passes=[])
    before.lower(**zm.make_inputs(seed=1))
    after = compile_dit(zm.model, passes=[passes.SVDQuantW4A4(rank=4, dynamic=True)])
    after.lower(**zm.make_inputs(seed=1))
    gone = sum(n.target is linear for n in before.graph.nodes) - sum(n.target is linear for n in after.graph.nodes)
    assert gone == cell.changed["replaced"], (gone, cell.changed)
    check.k_multiple = 1  # the zoo's widths
    cell = coverage.run_cell("sana", check, 60)
    assert cell.status == "error" and "changed nothing" in cell.detail and "K % 64" in cell.detail, cell


def test_group_widths_keep_the_head_width():
    """Every family's quantization build: heads x head_dim a multiple of 64, the head width (and with it the rope's
    axes) as in the zoo; a family already that wide is left as it is."""
    from dit_passes.models.diffusers_zoo import coverage_rows
    for family in [f for r in coverage_rows() if r.excluded is None for f in r.families]:
        spec = zoo.family_spec(family)
        config = zoo.config_for(family)
        heads, head_dim = spec.heads_and_head_dim(config)
        widths = zoo.group_widths(family, 64)
        config.update(widths)
        if spec.tied_config is not None:
            config.update({k: v for k, v in spec.tied_config(config).items() if k not in widths})
        wide_heads, wide_head_dim = spec.heads_and_head_dim(config)
        assert (wide_heads * wide_head_dim) % 64 == 0 and wide_head_dim == head_dim, (family, widths)
        assert bool(widths) == ((heads * head_dim) % 64 != 0), (family, widths)


def test_cache_columns_compare_the_cached_steps():
    """The cache columns' loop moves the latents, so a cached step's output is not the last computed one: the
    comparison with cache-dit over the loop sees the cached steps (a cache that kept the first block's count at 2
    instead of 1 caches the same steps and differs from it there), and TaylorSeer's forecast is exercised (its
    cached steps differ from DBCache's)."""
    from dit_passes import compile_dit, passes
    from dit_passes.cache.config import TaylorSeerCalibratorConfig
    from dit_passes.coverage_cells import LOOP_STEPS, _cache_dit_run, _denoise, _moving_key
    pytest.importorskip("cache_dit")
    torch.set_num_threads(1)
    loop = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=2,
                max_continuous_cached_steps=2, enable_separate_cfg=False)
    cell = coverage.run_cell("flux", coverage._local_checks()["dbcache"], 120)
    assert cell.status == "exact" and "vs cache-dit" in cell.detail and cell.cached_steps >= 2, cell

    def ours(cfg, calibrator=None):
        zm = zoo.build("flux", redraw_zeros=True)
        inputs = zm.make_inputs(seed=1)
        cal = None if calibrator is None else TaylorSeerCalibratorConfig(**calibrator)
        compiled = compile_dit(zm.model, passes=[passes.DBCache(calibrator=cal, **cfg)])
        key = _moving_key(inputs, zm.model(**inputs))
        outs, _ = _denoise(compiled, inputs, key)
        cached = compiled.report("dbcache").last_generation()["step_cached"]
        return outs, [i for i, c in enumerate(cached) if c], zm, inputs, key

    plain, cached, zm, inputs, key = ours(loop)
    assert len(cached) >= 2 and "hidden_states" == key
    other, other_cached = _cache_dit_run(zm.model, inputs, key, dict(loop, Fn_compute_blocks=2), None)
    assert other_cached == cached
    assert max(coverage._max_rel(plain[i], other[i]) for i in cached) > 1e-3
    assert all(coverage._max_rel(plain[i], other[i]) <= coverage.TOLERANCE
               for i in range(min(cached)))  # the steps before the first cached one agree: the cache is what differs
    assert LOOP_STEPS == len(plain)
    taylor, taylor_cached, *_ = ours(loop, dict(taylorseer_order=1))
    assert taylor_cached == cached
    assert max(coverage._max_rel(taylor[i], plain[i]) for i in cached) > 1e-3
