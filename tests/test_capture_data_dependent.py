"""Capture of models whose token counts come from the inputs' values (masks): ``nonzero`` (also as a tuple),
boolean-mask indexing, ``repeat_interleave`` with tensor repeats, ``bool()`` / ``int()`` of a traced tensor and
tensor slice bounds (``x[:, :mask.sum()]``) are specialised on the call's values and guarded."""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.capture import capture


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.proj(x).tanh()


class _MaskedTokens(torch.nn.Module):
    """Keeps the tokens its mask selects (several ways), runs two blocks on them, scatters them back."""

    def __init__(self, how: str, dim: int = 8):
        super().__init__()
        self.how = how
        self.blocks = torch.nn.ModuleList([_Block(dim), _Block(dim)])

    def forward(self, hidden_states, mask):
        keep = mask[0] != 0
        if self.how in ("nonzero", "nonzero_tuple", "repeat_interleave"):
            if self.how == "nonzero":
                rows = torch.nonzero(keep).flatten()
            elif self.how == "nonzero_tuple":
                rows = keep.nonzero(as_tuple=True)[0]
            else:  # each position repeated 0 or 1 times: the kept positions
                rows = torch.arange(keep.shape[0]).repeat_interleave(keep.long())
            x = hidden_states.index_select(1, rows)
        elif self.how == "slice":  # the first keep.sum() tokens: tensor slice bounds, read and written
            n = keep.sum()
            x = hidden_states[:, :n].clone()
            x[:, n - 1:] = 0.0
        else:
            x = hidden_states[:, keep]
        if self.how == "bool" and bool(keep.all()):
            x = x * 2
        if self.how == "int" and bool(keep.sum()):  # bool() of a count (not 0 / 1), int() of it
            x = x * int(keep.sum())
        for block in self.blocks:
            x = block(x)
        return (hidden_states.masked_scatter(keep[None, :, None].expand_as(hidden_states), x),)


@pytest.mark.parametrize("how", ["nonzero", "nonzero_tuple", "repeat_interleave", "mask_index", "bool", "int",
                                 "slice"])
def test_data_dependent_token_counts_are_specialised_and_guarded(how):
    torch.manual_seed(0)
    model = _MaskedTokens(how).eval()
    x = torch.randn(1, 6, 8)
    masks = [torch.tensor([[1, 1, 0, 1, 0, 1]]), torch.tensor([[1, 1, 1, 1, 1, 1]])]
    captured = capture(model, (), {"hidden_states": x, "mask": masks[0]})
    assert captured.baked_scalars, "the count of kept tokens is baked into the graph"
    compiled = compile_dit(model)
    with torch.no_grad():
        for mask in masks + masks[:1]:  # another count: a second graph, keyed on the mask's values
            ref = model(hidden_states=x, mask=mask)[0]
            out = compiled(hidden_states=x, mask=mask)[0]
            assert torch.equal(out, ref)
    assert len(compiled.graphs) == 2
