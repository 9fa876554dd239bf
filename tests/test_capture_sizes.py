"""Capture at sizes other than a model's sample size, where its forward builds a positional table at the input's
size (``dit_passes.capture_tensor_data``, ``dit_passes.capture_caches``).

Reference: the eager model on the same inputs, fp32, max relative error <= 1e-5, at the other size and at the
sample size, through one compiled module (a graph per size)."""
from __future__ import annotations

import datetime
import os
import random

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.capture import CaptureError, capture
from dit_passes.coverage_cells import _max_rel
from dit_passes.models import zoo

TOLERANCE = 1e-5


def _table(n: int, d: int) -> torch.Tensor:
    """A sincos table of ``n`` positions, built in fp64 from Python ints (as diffusers' sincos helpers do)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None] * torch.arange(1, d + 1, dtype=torch.float64)[None] / d
    return torch.sin(pos)


class _TableWrittenThroughData(torch.nn.Module):
    """Keeps a table for its sample length; at another length builds one in forward and writes it into a
    zero-padded tensor through ``.data`` (CogVideoX's patch embedder does exactly this)."""

    def __init__(self, sample: int = 4, pad: int = 2):
        super().__init__()
        self.sample, self.pad = sample, pad
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("pos", self._joint(sample), persistent=False)

    def _joint(self, n: int) -> torch.Tensor:
        table = _table(n, 8)
        joint = table.new_zeros(1, self.pad + n, 8)
        joint.data[:, self.pad:].copy_(table)
        return joint

    def forward(self, x):
        pos = self.pos if x.shape[1] == self.sample else self._joint(x.shape[1])
        return (self.proj(x) + pos[:, self.pad:].to(x.dtype),)


class _WeightReadThroughData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return (x @ self.weight.data,)


class _TableRegisteredAsBuffer(torch.nn.Module):
    """Registers the table of the input's length over its sample-length buffer."""

    def __init__(self, sample: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("pos", _table(sample, 8).float(), persistent=False)

    def forward(self, x):
        if self.pos.shape[0] != x.shape[1]:
            self.register_buffer("pos", _table(x.shape[1], 8).float(), persistent=False)
        return (self.proj(x) + self.pos,)


class _DataAssigned(torch.nn.Module):
    def forward(self, x):
        table = torch.zeros(4, 8)
        table.data = _table(x.shape[1], 8).float()
        return x + table


class _HoldsDataAssigned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.proj = _DataAssigned(), torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.proj(self.inner(x)),)


def _check_sizes(model, calls, dit: bool = True) -> None:
    """One compiled module (a DiT; else one capture per call) called with each of ``calls`` (keyword dicts) equals
    the eager model on each, and leaves the eager model as it was."""
    compiled = compile_dit(model, passes=[]) if dit else None
    for kwargs in calls:
        with torch.no_grad():
            ref = model(**kwargs)
            if dit:
                out = compiled(**kwargs)
            else:
                captured = capture(model, (), kwargs)
                out = captured.gm(*[kwargs[name] for name in captured.input_names])
            again = model(**kwargs)  # the eager model after the capture: no trace state left in it
        assert _max_rel(out, ref) <= TOLERANCE, {k: tuple(v.shape) for k, v in kwargs.items() if torch.is_tensor(v)}
        assert _max_rel(again, ref) == 0.0
    assert not dit or len(compiled.graphs) == len(calls)


def test_table_written_through_data_captures_at_other_lengths():
    torch.manual_seed(0)
    model = _TableWrittenThroughData().eval()
    _check_sizes(model, [{"x": torch.randn(2, n, 8)} for n in (6, 4, 3)], dit=False)


def test_weight_read_through_data_captures():
    torch.manual_seed(0)
    model = _WeightReadThroughData().eval()
    captured = capture(model, (), {"x": torch.randn(2, 5, 8)})
    x = torch.randn(2, 5, 8)
    assert torch.equal(captured.gm(x)[0], model(x)[0])


def test_buffer_registered_in_forward_is_put_back_after_capture():
    """The trace registers a FakeTensor over the buffer; the eager model then computed on it (a fake result)."""
    torch.manual_seed(0)
    model = _TableRegisteredAsBuffer().eval()
    before = model.pos
    captured = capture(model, (), {"x": torch.randn(2, 6, 8)})
    assert model.pos is before
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        assert torch.equal(captured.gm(x)[0], model(x)[0])
    _check_sizes(_TableRegisteredAsBuffer().eval(), [{"x": torch.randn(2, n, 8)} for n in (6, 4)], dit=False)


def test_data_assignment_runs_its_module_eagerly_or_is_refused_by_name():
    """``x.data = y`` is not traceable (export kept the old tensor: a wrong result without an error). Inside a
    submodule, that submodule runs eagerly (an opaque call); in the model's own forward, capture names it."""
    torch.manual_seed(0)
    model = _HoldsDataAssigned().eval()
    x = torch.randn(2, 6, 8)
    captured = capture(model, (), {"x": x})
    assert any("opaque_module" in str(n.target) for n in captured.gm.graph.nodes)
    with torch.no_grad():
        assert torch.equal(captured.gm(x)[0], model(x)[0])
    with pytest.raises(CaptureError, match=r"tensor\.data = "):
        capture(_DataAssigned(), (), {"x": x})


def test_cogvideox_sincos_positions_at_another_frame_count():
    """CogVideoX-2b's sincos table (sample: 8 frames = 2 latent frames, 8 x 8) called on one latent frame."""
    model = zoo.model_class("cogvideox")(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
        patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=8).eval()
    zoo.redraw_zero_parameters(model, 0)
    gen = torch.Generator().manual_seed(0)

    def call(frames):  # (B, F, C, H, W) latents, as CogVideoXPipeline passes them
        return {"hidden_states": torch.randn(2, frames, 4, 8, 8, generator=gen),
                "encoder_hidden_states": torch.randn(2, 8, 8, generator=gen),
                "timestep": torch.tensor([3, 5]), "return_dict": False}

    _check_sizes(model, [call(1), call(2)])


def test_consisid_face_sincos_positions_at_another_frame_count():
    # one block: the sin-cos positions are built before the blocks, the face cross-attention runs at every block
    zm = zoo.build("consisid", redraw_zeros=True, is_train_face=True, use_rotary_positional_embeddings=False,
                   num_layers=1)
    calls = [zm.make_inputs(variant="alt_resolution", seed=1), zm.make_inputs(seed=1)]
    assert calls[0]["hidden_states"].shape[1] != calls[1]["hidden_states"].shape[1]
    _check_sizes(zm.model, calls)


# ----------------------------------------------------------------------------- every family at a second size
SECOND = "alt_resolution"
EVERY_FAMILY = zoo.FAMILIES + zoo.MORE_FAMILIES_HERE + zoo.VARIANTS_HERE
# All 130 (families and variants) took 1352 s on the shared 2-core CPU (build, eager, capture, compare: a median of
# 6.5 s each, up to 68 s; bench/results/coverage_alt_resolution.md), too long for CI: a regular run takes a sample of
# SAMPLED that rotates daily; DIT_PASSES_FULL_SWEEP=1 runs them all, as does
# `dit-passes coverage --columns capture --no-parallel --inputs alt_resolution`.
SAMPLED = 2


def _sampled_families() -> tuple[int, list[str]]:
    """A sample that rotates daily (the seed is the UTC date's ordinal, named in a failure)."""
    if os.environ.get("DIT_PASSES_FULL_SWEEP") == "1":
        return 0, list(EVERY_FAMILY)
    seed = datetime.datetime.now(datetime.timezone.utc).date().toordinal()
    return seed, sorted(random.Random(seed).sample(EVERY_FAMILY, SAMPLED))


def _shapes(family: str, variant: str) -> list:
    leaves = torch.utils._pytree.tree_leaves(zoo.inputs_for(family, variant))
    return [tuple(x.shape) if torch.is_tensor(x) else x for x in leaves]


def test_every_family_has_a_second_size():
    """Each family's second input set calls the model at another size than its first (cheap: no model built)."""
    same = [f for f in EVERY_FAMILY if _shapes(f, SECOND) == _shapes(f, "default")]
    assert not same, f"{same}: the {SECOND!r} inputs have the default's shapes"


def test_families_at_their_second_size_match_eager():
    seed, families = _sampled_families()
    failed = {}
    for family in families:
        zm = zoo.build(family, redraw_zeros=True)
        inputs = zm.make_inputs(variant=SECOND, seed=1)
        try:
            with torch.no_grad():
                ref = zm.model(**inputs)
                rel = _max_rel(compile_dit(zm.model, passes=[])(**inputs), ref)
            if not rel <= TOLERANCE:
                failed[family] = f"max relative error {rel:.2g}"
        except Exception as e:  # noqa: BLE001 - every family is reported, then the test fails
            failed[family] = f"{type(e).__name__}: {str(e)[:300]}"
    assert not failed, f"at {SECOND!r} (sample seed {seed}): {failed}"


def test_coverage_runs_its_cells_at_the_second_size():
    """``dit-passes coverage --inputs alt_resolution`` (the whole set: every family at its second size): each cell
    calls with that input set, and a matrix of other inputs does not merge into one of it."""
    from dit_passes import coverage

    seen = []

    def shapes(zm, inputs, reference):
        seen.append(tuple(inputs["hidden_states"].shape))
        return "seen"

    cell = coverage.run_cell("dit", shapes, 60, inputs=SECOND)
    assert cell.status == coverage.EXACT, cell
    assert seen == [tuple(zoo.inputs_for("dit", SECOND)["hidden_states"].shape)]
    assert seen[0] != tuple(zoo.inputs_for("dit")["hidden_states"].shape)
    before = {"columns": ["capture"], "batch": 1, "tolerance": coverage.TOLERANCE}  # a matrix from before --inputs
    with pytest.raises(ValueError, match=r"inputs \(\['default'\] vs \['alt_resolution'\]\)"):
        coverage.merge_rows(before, dict(before, inputs=SECOND))
