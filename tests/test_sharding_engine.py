"""One sharding engine: the three rule tables (TP, sequence, VAE-P) share one op taxonomy and driver,
and VAE-P is a Pass run (and verified, and explained) by the PassManager."""
from __future__ import annotations

import pathlib
import re

import torch

from dit_passes.parallel import op_classes
from dit_passes.testing.multiproc import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dit_passes"
SHARDING_FILES = sorted((ROOT / "parallel").glob("*.py")) + [
    ROOT / "passes" / n for n in ("tensor_parallel.py", "context_parallel.py", "vae_parallel.py", "parallel_plan.py")]
# a module-level set or dict literal of ATen overloads: an op class
OP_CLASS = re.compile(r"^(\w+)\s*=[^\n=]*\{[^\n]*\baten\.", re.M)


def test_op_classes_are_defined_once_in_op_classes():
    found = {}
    for path in SHARDING_FILES:
        for m in OP_CLASS.finditer(path.read_text()):
            found.setdefault(path.name, []).append(m.group(1))
    assert set(found) == {"op_classes.py"}, found
    assert {"RESHAPES", "LIKE_ARG0", "REDUCTIONS", "SPLITS", "LAYER_NORMS", "MIXING"} <= set(found["op_classes.py"])
    # the three rule tables read it
    for name in ("tp_sharding.py", "sequence_sharding.py", "vae_ops.py", "vae.py"):
        assert "op_classes as oc" in (ROOT / "parallel" / name).read_text(), name
    assert op_classes.is_pointwise(torch.ops.aten.mul.Tensor) and not op_classes.is_pointwise(op_classes.SDPA)


class _Slab(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)

    def forward(self, x):
        return self.norm(self.conv(x)).relu()


def _vae_pass_ranks(rank, world):
    from dit_passes import PassManager
    from dit_passes.capture import capture
    from dit_passes.passes import VAEParallel
    from dit_passes.parallel.vae_ops import split_rows

    model, x = _Slab().eval(), torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(1))
    full = capture(model, (x,)).gm
    rows = split_rows(7, world)
    gm = capture(model, (x.narrow(2, sum(rows[:rank]), rows[rank]),)).gm
    manager = PassManager([VAEParallel(world, rows=rows, reference=full)])
    manager.run(gm)
    with torch.no_grad():
        err = ((gm(x)[0] - model(x)).abs().max() / model(x).abs().max()).item()
    return {"explain": manager.explain(), "counts": manager.records[0].result.counts, "err": err,
            "vals": all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")}


def test_vae_parallel_is_a_verified_explained_pass():
    for r in run_ranks(_vae_pass_ranks, 2, timeout=240):
        assert r["err"] <= 1e-5, r
        assert "== vae_parallel(size=2, rows=[4, 3])" in r["explain"], r["explain"][:300]
        assert "vae_halo_exchange" in r["explain"] and r["vals"]  # the diff shows the rewrite; verify_graph's check holds
        assert r["counts"] == {"halo_exchange": 1, "all_reduce": 1, "all_gather": 1}, r["counts"]
