"""Shared pieces of the tiny-model zoo: the per-family spec record and seeded input helpers.

A :class:`FamilySpec` is an immutable description of one diffusers transformer family: the model class
name, a tiny config, a function that writes the forward's keyword arguments for a given size table
entry, and what the model is expected to look like once captured (block lists, streams, heads).
``dit_passes.models.zoo`` turns a spec into a built :class:`~dit_passes.models.zoo.ZooModel`.

Batch convention (every family): ``batch=1`` is one conditional call; ``batch=2`` is a CFG pair as the
pipelines build it: the *same* latent and timestep twice, with two different text conditionings (row 1
plays the negative prompt and, where the model takes a text mask, has its last tokens padded out).
Row 0 of a ``batch=2`` call is bit-identical to the ``batch=1`` call with the same seed, because every
row-0 tensor is drawn first, in the same order.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

# Number of trailing text tokens that the second (negative-prompt) row of a CFG batch masks out.
NEG_PAD_TOKENS = 2
# Largest batch make_inputs supports (a CFG pair).
MAX_BATCH = 2


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Static description of one family (no model object, no mutable state).

    ``inputs(config, batch, sizes, gen)`` returns the forward kwargs for the size-table entry
    ``sizes`` (a mapping such as ``{"grid": (4, 4), "text": 8}``), drawing every random tensor from
    ``gen``. ``sizes_by_variant`` maps each variant name to its size entry; ``expected`` is merged with
    the per-variant token counts by the zoo.
    """

    name: str
    class_name: str
    config: Mapping[str, Any]
    inputs: Callable[[Mapping[str, Any], int, Mapping[str, Any], torch.Generator], dict]
    sizes_by_variant: Mapping[str, Mapping[str, Any]]
    tokens: Callable[[Mapping[str, Any], Mapping[str, Any]], dict]
    expected: Mapping[str, Any]
    pipeline_class: str | None
    # block-list path -> config field holding its length (main stack, then lists outside it)
    block_list_keys: Mapping[str, str]
    aux_list_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    heads_key: str = "num_attention_heads"
    # config field of the per-head width, or None where it is derived as hidden_key / heads
    head_dim_key: str | None = "attention_head_dim"
    hidden_key: str | None = None
    # run one eager forward at build: the model fills a lazy cache on its first call, and a first call
    # under torch.export would cache *fake* tensors into the model (breaking later eager calls)
    warm_up: bool = False
    # (heads, head_dim) from the config, for a class whose config has no heads field
    heads_of: Callable[[Mapping[str, Any]], tuple[int, int]] | None = None
    # set up the built model the way its parent does (DreamLite's UNet installs its own attention processors)
    after_build: Callable[[torch.nn.Module], None] | None = None
    # config -> the fields the class needs to agree with fields a caller may change (HiDream's llama_layers: one per
    # block); ``build`` applies it after the overrides, to every field the overrides do not name
    tied_config: Callable[[Mapping[str, Any]], dict] | None = None
    # config fields that are widths of the block linears besides heads x head_dim (a cross-attention's or a second
    # stream's width, a modulation embedding): ``zoo.group_widths`` scales them with the heads, so a wider build
    # keeps every block linear's K a multiple of a quantization group
    width_keys: tuple[str, ...] = ()

    def heads_and_head_dim(self, config: Mapping[str, Any]) -> tuple[int, int]:
        if self.heads_of is not None:
            return self.heads_of(config)
        heads = int(config[self.heads_key])
        if self.head_dim_key is not None:
            return heads, int(config[self.head_dim_key])
        return heads, int(config[self.hidden_key]) // heads

    def __post_init__(self):
        # Freeze the nested tables so that no caller can edit the zoo's constants in place.
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(
            self,
            "sizes_by_variant",
            MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.sizes_by_variant.items()}),
        )
        object.__setattr__(self, "expected", MappingProxyType(dict(self.expected)))
        object.__setattr__(self, "block_list_keys", MappingProxyType(dict(self.block_list_keys)))
        object.__setattr__(self, "aux_list_keys", MappingProxyType(dict(self.aux_list_keys)))
        if "default" not in self.sizes_by_variant or "alt_resolution" not in self.sizes_by_variant:
            raise ValueError(f"family {self.name!r} must define the 'default' and 'alt_resolution' variants")


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard-normal fp32 CPU tensor drawn from ``gen``."""
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def cfg_rows(gen: torch.Generator, batch: int, *shape: int) -> torch.Tensor:
    """A latent-like tensor for a CFG call: one draw, repeated ``batch`` times along dim 0."""
    check_batch(batch)
    one = randn(gen, 1, *shape)
    return one.expand(batch, *shape).contiguous()


def text_rows(gen: torch.Generator, batch: int, *shape: int) -> torch.Tensor:
    """A text-embedding tensor: one independent draw per row.

    Always draws :data:`MAX_BATCH` rows and keeps the first ``batch``, so the generator advances the
    same way for every batch size and row 0 of a CFG call equals the batch-1 call.
    """
    check_batch(batch)
    return randn(gen, MAX_BATCH, *shape)[:batch].contiguous()


def timestep_rows(gen: torch.Generator, batch: int, scale: float) -> torch.Tensor:
    """One timestep in ``(0.05, 0.95) * scale`` repeated for every row (CFG rows share the step)."""
    check_batch(batch)
    t = 0.05 + 0.9 * torch.rand(1, generator=gen, dtype=torch.float32)
    return (t * scale).expand(batch).contiguous()


def text_mask(batch: int, text_len: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Text mask: row 0 fully valid, rows >= 1 with the last :data:`NEG_PAD_TOKENS` tokens padded."""
    check_batch(batch)
    if text_len <= NEG_PAD_TOKENS:
        raise ValueError(f"text length {text_len} is too short for a padded negative row; use > {NEG_PAD_TOKENS}")
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    mask[1:, text_len - NEG_PAD_TOKENS:] = False
    return mask.to(dtype)


def grid_ids(t: int, h: int, w: int, extra_axes: int = 0) -> torch.Tensor:
    """Integer position ids ``(t*h*w, 3 + extra_axes)`` laid out as [t, row, col, 0...] (float32)."""
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    cols = [tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]
    cols += [torch.zeros(t * h * w, dtype=torch.long)] * extra_axes
    return torch.stack(cols, dim=-1).to(torch.float32)


def check_batch(batch: int) -> None:
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be 1 (conditional call) or 2 (CFG pair), got {batch!r}")


def image_text_tokens(image: int, text: int) -> dict:
    return {"image": int(image), "text": int(text)}


def fp32_tables(model: torch.nn.Module) -> None:
    """CogVideoX's patch embedder builds its sincos table in fp64 (diffusers' sincos helpers default to fp64 off MPS);
    with ``use_learned_positional_embeddings`` the table is a persistent buffer (a checkpoint loads over it), which
    broke the zoo's fp32 promise. The forward casts it to the embeddings' dtype, so fp32 changes no result."""
    model.float()


def with_flag_inputs(builder: Callable, extras: Mapping[str, Callable]) -> Callable:
    """``builder`` (config, batch, sizes, gen) -> inputs, plus the inputs a class requires when a config flag is on:
    ``extras`` maps the flag to ``(config, batch, inputs, gen) -> {name: value}``. The zoo's configs leave those flags
    off; configs drawn around them (``dit-passes fuzz``) turn them on, and the class then refuses a call without them.
    An extra draws after ``builder`` (from the same ``gen``), so the inputs of the flag-off call keep their values."""
    def inputs(config, batch, sizes, gen):
        out = builder(config, batch, sizes, gen)
        for flag, make in extras.items():
            if config.get(flag):
                out.update(make(config, batch, out, gen))
        return out
    return inputs


def inner_width(*fields: str, heads: str = "num_attention_heads", head_dim: str = "attention_head_dim") -> Callable:
    """A ``tied_config``: ``fields`` hold the blocks' heads x head_dim width. Classes read such a field where the
    width arrives from outside the attention (a caption projection feeding the cross-attention's keys, a context
    projection joined to the image tokens); every checkpoint sets it to that width, and the zoo's fixed value broke
    a drawn head count (shape mismatches)."""
    def tied(config: Mapping[str, Any]) -> dict:
        width = int(config[heads]) * int(config[head_dim])
        return {f: width for f in fields}
    return tied
