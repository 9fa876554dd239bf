"""The ``dit-passes`` console script (dit_passes.cli:main)."""
from __future__ import annotations

import importlib.util
import re

import pytest

from dit_passes.cli import available_passes, main
from dit_passes.testing import run_ranks


def test_inspect_prints_structure_and_passes(capsys):
    assert main(["inspect", "flux"]) == 0
    out = capsys.readouterr().out
    assert "block lists: transformer_blocks x2" in out and "single_transformer_blocks x2" in out
    assert "4 blocks, 2 residual stream(s)" in out
    assert "== cleanup()" in out and "assert_removed=" in out and "+++ after" in out
    assert "## graph" not in out


def test_inspect_graph_variant_and_no_passes(capsys):
    assert main(["inspect", "wan", "--passes", "", "--variant", "alt_resolution", "--graph"]) == 0
    out = capsys.readouterr().out
    assert "variant=alt_resolution" in out and "blocks x2" in out
    assert "no passes ran" in out  # --passes "" disables even cleanup
    assert "## graph" in out and "torch.ops.aten.scaled_dot_product_attention.default" in out


def _one_line_error(capsys, argv, *expected):
    """``main(argv)`` exits 2 with one line on stderr holding each of ``expected``, no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    # (the first import of diffusers may log its own lines, e.g. about torchao, before ours)
    err = [line for line in captured.err.splitlines() if line.startswith("dit-passes")]
    assert len(err) == 1 and err[0].startswith("dit-passes: ") and "Traceback" not in captured.err, captured.err
    for part in expected:
        assert part in err[0], (part, err[0])
    return err[0]


def test_inspect_bad_arguments(capsys):
    _one_line_error(capsys, ["inspect", "not_a_model"], "unknown model 'not_a_model'; zoo families: flux")
    _one_line_error(capsys, ["inspect", "flux", "--variant", "huge"], "has no variant 'huge'")
    _one_line_error(capsys, ["inspect", "flux", "--passes", "cleanup,nope"],
                    "unknown pass 'nope'; known passes: ", "cleanup", "dbcache", "tensor_parallel", "ulysses")


def test_user_mistakes_are_one_line_naming_the_fix(capsys):
    # each is refused before anything is captured: the whole test takes well under a second
    _one_line_error(capsys, ["inspect", "wan", "--passes", "ulysses"],
                    "missing 1 required positional argument: 'size'", "ulysses takes (size, float8=False")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "ulysses(sise=2)"], "unexpected keyword argument 'sise'")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "dbcache(residual_diff_threshold=__import__('os'))"],
                    "is not a literal")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "dbcache(Fn_compute_blocks="],
                    "cannot read the pass list")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "dbcache(Fn_compute_blocks=3)"],
                    "leaves no block to cache: wan has 2", '--passes "dbcache(Fn_compute_blocks=1)"')
    _one_line_error(capsys, ["inspect", "wan", "--passes", "dbcache(Bn_compute_blocks=1)"],
                    "= 8 + 1 leaves no block to cache: wan has 2",
                    '--passes "dbcache(Bn_compute_blocks=0, Fn_compute_blocks=1)"')
    _one_line_error(capsys, ["inspect", "wan", "--passes", "dbcache(max_warmup_steps='x')"],
                    "dbcache(max_warmup_steps='x'):", "Fn_compute_blocks=8")  # the config's own refusal + fields
    _one_line_error(capsys, ["inspect", "wan", "--passes", "cleanup(1)"], "cleanup(1):")
    _one_line_error(capsys, ["inspect", "wan", "--rank", "1"], "no parallel pass", "drop --rank")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "ulysses(size=2)", "--rank", "2"], "pick one of 0..1")
    _one_line_error(capsys, ["inspect", "wan", "--passes", "cleanup", "--no-cleanup"], "drop one of them")


def test_a_default_cut_adapts_around_the_one_given(capsys):
    # Bn=1 given on zoo Flux's 4 blocks: the default Fn=8 becomes 2 (blocks 0-1 computed, 2 cached, 3 computed)
    assert main(["inspect", "flux", "--passes", "dbcache(Bn_compute_blocks=1)"]) == 0
    out = capsys.readouterr().out
    assert ("note: dbcache: the default Fn_compute_blocks=8 leaves no block of flux's 4 to cache; using "
            "dbcache(Bn_compute_blocks=1, Fn_compute_blocks=2)") in out
    assert "DBCache_F2B1_" in out


def test_a_pass_refusing_the_model_is_one_line_and_debug_shows_the_traceback(capsys):
    import torch.distributed as dist

    from dit_passes.infra.pass_base import PassError

    # refused inside the fake world of 2 ranks (dbprune's default cut adapted first): the world is gone afterwards
    argv = ["inspect", "wan", "--passes", "ulysses(size=2),dbprune"]
    line = _one_line_error(capsys, argv, "dbprune: pruning under context / tensor parallelism is not implemented")
    assert not dist.is_initialized()
    with pytest.raises(PassError) as info:
        main(argv + ["--debug"])
    assert " ".join(str(info.value).split()) in line
    assert not dist.is_initialized()


def _graph_printed(capsys, argv):
    assert main(argv + ["--graph"]) == 0
    out = capsys.readouterr().out
    return out[out.index("## graph\n") + len("## graph\n"):]


def _same_up_to_group_names(code):
    """``code`` with each process group's name replaced by the order it first appears in: a name is a counter of
    the groups its process made ('0', '1', ...; a subgroup's a hash of it), and a pooled rank has made more. Which
    collectives share a group still has to match."""
    names = {}
    return re.sub(r"'(\d+|[0-9a-f]{40})'", lambda m: f"'group{names.setdefault(m.group(1), len(names))}'",
                  code).strip()


PARALLEL_PIPELINES = ("ulysses(size=2),dbcache(Fn_compute_blocks=1)", "tensor_parallel(size=2)")


def _real_rank_graphs(rank, world):
    from dit_passes import compile_dit
    from dit_passes.models.zoo import build
    from dit_passes.pass_spec import parse_pass_specs

    out = {}
    for text in PARALLEL_PIPELINES:
        zm = build("flux", seed=0)
        c = compile_dit(zm.model, passes=[s.build() for s in parse_pass_specs(text)],
                        example_inputs=zm.make_inputs(batch=1, variant="default"))
        out[text] = c.code
    return out


def test_fake_rank_graph_is_the_real_ranks_graph(capsys):
    """The graph ``inspect --rank R`` prints from one process is, node for node and shape for shape, the graph
    rank R of a real 2-rank gloo launch lowers (collectives included); only the groups' names may differ."""
    real = run_ranks(_real_rank_graphs, 2, timeout=400)
    for text in PARALLEL_PIPELINES:
        collectives = ("ulysses_attention", "gather_sequence") if "ulysses" in text else ("all_reduce",)
        # rank 1: its slices start past rank 0's, so an offset taken from the wrong rank shows
        printed = _graph_printed(capsys, ["inspect", "flux", "--passes", text, "--rank", "1"])
        assert all(op in printed for op in collectives), text
        assert _same_up_to_group_names(printed) == _same_up_to_group_names(real[1][text]), text
    ulysses = PARALLEL_PIPELINES[0]
    # the ranks' graphs differ beyond group names: matching rank 1's means the fake world lowered as rank 1
    assert _same_up_to_group_names(real[0][ulysses]) != _same_up_to_group_names(real[1][ulysses])


# what each documented example must show besides running (exit status 0)
EXAMPLE_SHOWS = {
    "dit-passes inspect flux": ["4 blocks, 2 residual stream(s)", "== cleanup()"],
    "dit-passes inspect wan --passes dbcache --graph": [
        "note: dbcache: the default Fn_compute_blocks=8 leaves no block of wan's 2 to cache; using "
        "dbcache(Fn_compute_blocks=1)", "DBCache_F1B0_", "torch.ops.higher_order.cond"],
    'dit-passes inspect wan --passes "cleanup,dbcache(Fn_compute_blocks=1,residual_diff_threshold=0.12)"': [
        "DBCache_F1B0_W8I1M0MC0_R0.12"],
    'dit-passes inspect flux --passes "ulysses(size=2)" --rank 1 --graph': [
        "rank 1 of 2, lowered under a fake process group", "ulysses_attention", "gather_sequence"],
    'dit-passes inspect flux --passes "ring(size=2),tensor_parallel(size=2),dbcache(Fn_compute_blocks=1)"': [
        "rank 0 of 4", "== tensor_parallel(size=2", "== ring(size=2", "DBCache_F1B0_"],
}


def test_help_shows_every_tested_example(capsys):
    from dit_passes.cli import INSPECT_EXAMPLES
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    helped = capsys.readouterr().out
    assert [cmd for cmd, _ in INSPECT_EXAMPLES] == list(EXAMPLE_SHOWS)
    assert all(cmd in helped for cmd in EXAMPLE_SHOWS)


@pytest.mark.parametrize("command", list(EXAMPLE_SHOWS))
def test_documented_example_runs(command, capsys):
    import shlex

    argv = shlex.split(command)
    assert argv[0] == "dit-passes"
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    for part in EXAMPLE_SHOWS[command]:
        assert part in out, (command, part)


def test_pass_text_names_arguments_and_refusals():
    from dit_passes import passes
    from dit_passes.pass_spec import PassSpecError, parse_pass_specs

    specs = parse_pass_specs(" Ulysses(2, float8=True), TENSOR_PARALLEL(size=2),PyramidAttentionBroadcast,"
                             "dbcache(Fn_compute_blocks=1, steps_computation_mask=[1, 0, 1], "
                             "max_accumulated_residual_diff_threshold=None),SVDQuantFewShot,svdquant_w4a4")
    assert [s.cls for s in specs] == [passes.Ulysses, passes.TensorParallel, passes.PyramidAttentionBroadcast,
                                      passes.DBCache, passes.SVDQuantFewShot, passes.SVDQuantW4A4]
    assert [str(s) for s in specs[:3]] == ["ulysses(2, float8=True)", "tensor_parallel(size=2)", "pab"]
    built = [s.build() for s in specs[:4]]
    assert (built[0].ulysses_size, built[0].ulysses_float8, built[1].size) == (2, True, 2)
    assert built[3].config.Fn_compute_blocks == 1 and built[3].config.steps_computation_mask == [1, 0, 1]
    assert parse_pass_specs("") == [] and parse_pass_specs("  ") == []
    # nothing in the text is evaluated: a call, a name or an operator inside an argument is refused as text
    for text, message in [("dbcache(Fn_compute_blocks=exit())", "is not a literal"),
                          ("dbcache(Fn_compute_blocks=os.sep)", "is not a literal"),
                          ("passes.DBCache()", "is not a pass"),
                          ("dbcache(**{'Fn_compute_blocks': 1})", "* and ** are not arguments"),
                          ("ulysses(size=2, group=None)", "group cannot be given as text"),
                          ("ulysses(size=2", "cannot read the pass list"),
                          ("dbcach", "unknown pass 'dbcach'; known passes: ")]:
        with pytest.raises(PassSpecError, match=re.escape(message)):
            parse_pass_specs(text)


def test_pass_registry_names():
    reg = available_passes()
    assert "cleanup" in reg and all(cls.name == name for name, cls in reg.items())


def test_delegated_command_missing_module_is_a_clear_error(monkeypatch, capsys):
    from dit_passes import cli
    monkeypatch.setitem(cli.DELEGATED, "demo", ("dit_passes.no_such_module", "x"))
    assert main(["demo", "--anything"]) == 2
    assert "dit_passes.no_such_module does not exist yet" in capsys.readouterr().err


def test_fidelity_and_bench_commands_run(tmp_path, capsys):
    # (the demo itself runs in tests/test_demo_plain_install.py, as a plain install runs it)
    import json
    assert main(["fidelity", "--list"]) == 0
    assert "ultra_mask_taylorseer" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown config"):
        main(["fidelity", "--configs", "nope", "--out", str(tmp_path / "f")])
    assert main(["bench", "--size", "tiny", "--rows", "graph,dbcache_always", "--repeats", "1",
                 "--out", str(tmp_path / "bench")]) == 0
    report = json.loads((tmp_path / "bench" / "bench_flux_tiny.json").read_text())
    assert report["rows"]["dbcache_always"]["cached_steps"] == 20  # 28 steps, 8 warm-up: every other step cached
    assert "| dbcache_always |" in capsys.readouterr().out
