"""A LoRA loaded or unloaded after a CompiledDiT lowered its graphs is honoured: the graphs ran the module as it was
captured, so a changed module tree drops them and lowers again (``graph_stats.module_changes``).

Reference: the eager transformer with the same adapters (``passes=[]`` computes its ATen ops in the same order:
bitwise equal, as ``tests/test_lora.py`` checks for a LoRA present before compiling).
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit

peft = pytest.importorskip("peft")
from dit_passes.models.zoo import build  # noqa: E402


def test_lora_loaded_and_unloaded_after_lowering_is_honoured():
    zm = build("flux")
    kw = zm.make_inputs()
    compiled = compile_dit(zm.model, passes=[])
    with torch.no_grad():
        base = compiled(**kw)[0]
        assert torch.equal(compiled(**kw)[0], base)
        assert compiled.graph_stats.lowered == 1  # the same module: its graph reused
        torch.manual_seed(1)
        zm.model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"],
                                             init_lora_weights="gaussian"))
        for name, p in zm.model.named_parameters():
            if ".lora_B." in name:  # PEFT starts B at zero (a no-op adapter): make it act
                p.normal_(0.0, 0.2)
        eager_lora = zm.model(**kw)[0]
        assert not torch.equal(eager_lora, base)  # the adapter changes the output: dropping it would show
        assert torch.equal(compiled(**kw)[0], eager_lora)
        assert compiled.graph_stats.module_changes == 1 and compiled.graph_stats.lowered == 2
        compiled.unload_lora()  # the original's PEFT method (through the wrapper): the linears put back
        assert torch.equal(compiled(**kw)[0], base)
    stats = compiled.graph_stats
    assert (stats.module_changes, stats.lowered, stats.graphs) == (2, 3, 1)
    assert "lowered again 2x after the module changed" in stats.summary()
