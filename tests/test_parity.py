"""The parity table's own checks (``bench/parity.py``): every cache-dit / diffusers name that dit_passes has is
claimed by a test that shows it working or refused; no claim names a row that does not exist; and the cache-dit
names dit_passes does not offer refuse at their first use, naming the reason."""
from __future__ import annotations

import ast
import importlib.util
import logging
import pathlib
import sys

import pytest

import dit_passes as dp
from dit_passes.frontend.not_offered import NOT_OFFERED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _parity():
    pytest.importorskip("cache_dit")
    spec = importlib.util.spec_from_file_location("parity", ROOT / "bench" / "parity.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("parity", mod)  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_claims_name_reference_rows():
    parity = _parity()
    result = parity.table()
    assert result["unknown_claims"] == [], "claims naming no cache-dit / diffusers name (a typo or a removed name)"
    assert result["summary"]["total"] > 150  # introspection found the reference's API


def test_every_name_here_is_claimed_by_a_test():
    parity = _parity()
    result = parity.table()
    unverified = [r["name"] for r in result["rows"] if r["status"] == "unverified"]
    assert not unverified, (f"{len(unverified)} cache-dit / diffusers names exist in dit_passes without a test "
                            f"that claims them (@pytest.mark.parity): {unverified}")


def test_a_claim_is_read_from_the_marker(tmp_path):
    parity = _parity()
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.parity('enable_cache', 'DBCacheConfig.Fn_compute_blocks')\n"
        "def test_a():\n    assert True\n"
        "class TestB:\n"
        "    @pytest.mark.parity('ENV', status='refused')\n"
        "    def test_b(self):\n        assert True\n")
    got = {(c.row, c.status, c.test) for c in parity.claims(tmp_path)}
    assert got == {("enable_cache", "works", "tests/test_x.py::test_a"),
                   ("DBCacheConfig.Fn_compute_blocks", "works", "tests/test_x.py::test_a"),
                   ("ENV", "refused", "tests/test_x.py::TestB::test_b")}
    (tmp_path / "test_x.py").write_text("import pytest\n@pytest.mark.parity('ENV', status='maybe')\n"
                                        "def test_a():\n    pass\n")
    with pytest.raises(ValueError, match="parity status 'maybe'"):
        parity.claims(tmp_path)


_REFUSED = ("BlockAdapter", "BlockAdapterRegister", "get_adapter", "ForwardPattern", "Pattern_0", "Pattern_1",
            "Pattern_2", "Pattern_3", "Pattern_4", "Pattern_5", "PatchFunctor", "ParamsModifier", "ENV")


@pytest.mark.parity("BlockAdapter", "BlockAdapterRegister", "get_adapter", "ForwardPattern", "Pattern_0", "Pattern_1",
                    "Pattern_2", "Pattern_3", "Pattern_4", "Pattern_5", "PatchFunctor", "ParamsModifier", "ENV",
                    status="refused")
def test_names_not_offered_refuse_at_first_use():
    assert sorted(_REFUSED) == sorted(NOT_OFFERED)  # the marker above lists exactly the refused names
    for name in _REFUSED:
        obj = getattr(dp, name)  # importing keeps working
        for use in (lambda: obj(), lambda: obj(object(), blocks=None), lambda: obj.Pattern_0):
            with pytest.raises(NotImplementedError, match=rf"cache_dit\.{name} is not offered by dit_passes: \w+"):
                use()
    with pytest.raises(NotImplementedError, match="block_lists"):
        dp.BlockAdapter(pipe=None, blocks=[])
    with pytest.raises(NotImplementedError, match="settings are arguments"):
        dp.ENV.CACHE_DIT_ENABLE_LOGGERS_SUPPRESS


@pytest.mark.parity("CacheType", "DBCache", "DBPrune", "NONE", "cache_type", "block_range", "BasicCacheConfig",
                    "DBCacheConfig.cache_type")
def test_cache_type_names_as_cache_dit():
    cache_dit = pytest.importorskip("cache_dit")
    for hint in ("DB", "dual_block_cache", "DBPrune", "dbp", "NONE", "nc", None):
        assert dp.cache_type(hint).value == cache_dit.cache_type(hint).value
    with pytest.raises(ValueError, match="unknown cache type"):  # the reference reads it as NONE: no cache
        dp.cache_type("FBCache")
    assert (dp.DBCache.value, dp.DBPrune.value, dp.NONE.value) == ("DBCache", "DBPrune", "NONE")
    assert str(dp.CacheType.DBCache) == str(cache_dit.CacheType.DBCache)
    for args in ((0, 10, 2), (2, 12, 3), (5, 3, 2), (0, 0, 2), (0, 8, 1)):
        assert dp.block_range(*args) == cache_dit.block_range(*args), args
    cfg = dp.BasicCacheConfig(cache_type=dp.CacheType.DBCache, Fn_compute_blocks=2)
    assert isinstance(cfg, dp.DBCacheConfig) and cfg.strify() == dp.DBCacheConfig(Fn_compute_blocks=2).strify()
    assert dp.DBPruneConfig(cache_type=dp.DBPrune).strify().startswith("DBPrune_")
    with pytest.raises(ValueError, match="NONE is not implemented"):
        dp.DBCacheConfig(cache_type=dp.NONE)


@pytest.mark.parity("init_logger", "disable_print", "maybe_empty_cache", "version_tuple")
def test_process_utilities(capsys):
    assert dp.init_logger("dit_passes.x") is logging.getLogger("dit_passes.x")
    with dp.disable_print():
        print("hidden")
    print("shown")
    assert capsys.readouterr().out == "shown\n"
    dp.maybe_empty_cache()
    assert dp.version_tuple == tuple(int(p) for p in dp.__version__.split("."))


def test_claims_are_literal():
    """bench/parity.py reads the markers without importing the tests: their arguments must be literals."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parity" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "mark":
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    ast.literal_eval(arg)  # raises on a non-literal


@pytest.mark.parity("ParallelismBackend", "QuantizeBackend")
def test_backend_enums_as_cache_dit():
    cache_dit = pytest.importorskip("cache_dit")
    for ours, theirs in ((dp.ParallelismBackend, cache_dit.ParallelismBackend),
                         (dp.QuantizeBackend, cache_dit.QuantizeBackend)):
        assert {m.name: m.value for m in ours} == {m.name: m.value for m in theirs}
    for name in ("auto", "native_pytorch", "NATIVE_DIFFUSER", "cache_dit"):
        assert dp.ParallelismBackend.from_str(name).value == cache_dit.ParallelismBackend.from_str(name).value
    assert dp.QuantizeBackend.from_str("ao") is dp.QuantizeBackend.TORCHAO
    # the configs take the members as they take the names
    assert dp.ParallelismConfig(tp_size=2, backend=dp.ParallelismBackend.NATIVE_PYTORCH).to_passes()
    with pytest.raises(ValueError, match="does not run Ulysses2"):
        dp.ParallelismConfig(ulysses_size=2, backend=dp.ParallelismBackend.NATIVE_PYTORCH)
    assert dp.QuantizeConfig(quant_type="svdq_int4_r16_dq", backend=dp.QuantizeBackend.CACHE_DIT).to_pass()
    with pytest.raises(ValueError, match="runs SVDQuant"):
        dp.QuantizeConfig(quant_type="float8_per_row", backend=dp.QuantizeBackend.CACHE_DIT)
