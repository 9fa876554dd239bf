"""A CFG batch of 2 in one call works too: DBCache on a batch of 2
(cond + uncond rows in one call), side by side with cache-dit 1.5.3: same cached steps, same diffs,
outputs within 1e-4 relative (fp32); a batch-2 graph is really used (not two batch-1 calls)."""
from __future__ import annotations

import pytest

cache_dit = pytest.importorskip("cache_dit")

from test_dbcache_pass import CONFIGS, FAMILIES, assert_same, ours_run, reference_run  # noqa: E402

from dit_passes.models.zoo import build  # noqa: E402


@pytest.mark.reference
@pytest.mark.parametrize("family, name", [("flux", "F1B1_interval2")])
def test_cfg_batch_of_two_matches_cache_dit(family, name):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs(batch=2)
    assert kwargs["hidden_states"].shape[0] == 2
    cfg = dict(CONFIGS[name], enable_separate_cfg=False)
    ref, ref_stats = reference_run(zm.model, kwargs, cfg)
    ours, stats, compiled = ours_run(zm.model, kwargs, cfg)
    assert ours.shape[1] == 2
    assert stats["cached_steps"] == ref_stats.cached_steps
    assert len(stats["cached_steps"]) >= 2, stats
    assert stats["residual_diffs"] == pytest.approx(dict(ref_stats.residual_diffs), rel=1e-5)
    assert_same(ref, ours)
    shapes = {tuple(n.meta["val"].shape)[0] for gm in compiled.graphs.values() for n in gm.graph.nodes
              if n.op == "placeholder" and n.name == "hidden_states"}
    assert shapes == {2}
