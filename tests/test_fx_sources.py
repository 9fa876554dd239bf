"""A module lowering again keeps no FX source of the graphs it dropped (``dit_passes/infra/fx_sources.py``): FX's
process-wide table of generated source (one entry per ``recompile()``, never emptied by torch) holds only what
the kept graphs run, however many times a served module lowers again (a new pass list, an evicted signature)."""
from __future__ import annotations

import pytest
import torch
import torch.fx.graph_module as fx_graph_module

from dit_passes import compile_dit
from dit_passes.models.zoo import build


def _table_size() -> int:
    return len(fx_graph_module._loader.eval_cache)  # torch's table itself: the reference for what is kept


def test_lowering_again_and_evicting_keep_the_fx_source_table_bounded():
    zm = build("flux")
    small, large = zm.make_inputs(batch=1), zm.make_inputs(batch=2)
    compiled = compile_dit(zm.model, passes=[], max_graphs=1)
    with torch.no_grad():
        compiled(**small)
        after_first = _table_size()
        for _ in range(2):
            compiled.set_passes(compiled.passes)  # every graph dropped, lowered again at the next call
            compiled(**small)
        assert _table_size() == after_first
        with pytest.warns(RuntimeWarning, match="keep evicting"):
            compiled(**large)  # a second signature evicts the first (max_graphs=1)
            compiled(**small)
    assert compiled.graph_stats.evicted == 2 and compiled.graph_stats.lowered == 5
    assert _table_size() == after_first
