"""The tiny-model zoo: small random-weight diffusers transformers with matching example inputs.

Every test of the project builds its models here, so the zoo is deterministic (weights from ``seed``,
inputs from their own ``seed``), small (2 heads x 16 channels, 2 blocks per list, 16-64 image tokens,
4-12 text tokens) and uses diffusers' default attention (the native backend: one
``scaled_dot_product_attention`` per attention call).

    zm = build("flux")                      # ZooModel: fp32, CPU, eval mode
    kwargs = zm.make_inputs(batch=2, variant="alt_resolution", seed=1)
    out = zm.model(**kwargs)                # tuple, as return_dict=False
    zm.expected["block_lists"]              # {"transformer_blocks": 2, "single_transformer_blocks": 2}

``FAMILIES`` are the curated families every test builds (``zoo_image`` / ``zoo_video``); ``MORE_FAMILIES_HERE``
the coverage-only ones (``zoo_more`` / ``zoo_more_av``: the rest of diffusers' DiT classes, for ``dit-passes
coverage``), built the same way by ``build``; ``diffusers_zoo.coverage_rows()`` maps every transformer class of
diffusers to them.

``expected`` holds what a correct capture must find:

* ``block_lists``: main-stack ``nn.ModuleList`` paths -> length, in execution order;
* ``aux_block_lists`` (when present): repeated lists outside the main stack (Hunyuan's token refiner,
  Chroma's approximator, the refiners of Z-Image / Lumina2), which discovery must *not* take as the stack;
* ``streams``: 2 for dual-stream models (image and text residuals kept apart in the first block list),
  1 for single-stream ones; ``streams_per_list`` gives the count of residual tensors each list's blocks
  take at their interface;
* ``attention_per_block``: ``scaled_dot_product_attention`` calls per block of each list (Sana's linear
  self-attention is counted apart in ``linear_attention_per_block``);
* ``heads`` / ``head_dim``; ``tokens``: ``{variant: {"image": n, "text": m}}`` (model tokens after
  patchification, before any internal padding); ``odd_variant`` (flux, flux2, qwenimage, chroma, wan):
  the variant with odd token counts; family-specific notes (``context_pre_only_last``, ``seq_multiple``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from types import MappingProxyType
from typing import Any, Callable

import diffusers
import torch

from dit_passes.models.zoo_common import FamilySpec
from dit_passes.models.zoo_extra_av import EXTRA_AV_FAMILIES
from dit_passes.models.zoo_extra_image import EXTRA_IMAGE_FAMILIES
from dit_passes.models.zoo_image import IMAGE_FAMILIES
from dit_passes.models.zoo_more import MORE_IMAGE_FAMILIES
from dit_passes.models.zoo_more_av import MORE_AV_FAMILIES
from dit_passes.models.zoo_variants import VARIANTS, variant_spec
from dit_passes.models.zoo_video import VIDEO_FAMILIES

__all__ = ["FAMILIES", "ALL_FAMILIES", "MORE_FAMILIES_HERE", "ALL_VARIANTS", "VARIANTS_HERE", "ZooModel", "build",
           "config_for", "class_name_of", "family_spec", "group_widths", "inputs_for", "model_class",
           "redraw_zero_parameters"]

_CURATED = IMAGE_FAMILIES + VIDEO_FAMILIES
MORE_FAMILIES = MORE_IMAGE_FAMILIES + MORE_AV_FAMILIES + EXTRA_IMAGE_FAMILIES + EXTRA_AV_FAMILIES
_BASE = {s.name: s for s in _CURATED + MORE_FAMILIES}
# the real-checkpoint variants ("flux[schnell]", zoo_variants): built like a family, listed apart
_VARIANT_SPECS = tuple(variant_spec(_BASE[v.family], v) for v in VARIANTS)
_SPECS: MappingProxyType = MappingProxyType({**_BASE, **{s.name: s for s in _VARIANT_SPECS}})

# Every family the zoo knows; the curated ones (the test suite's zoo: every test builds these) and the
# coverage-only ones (zoo_more: the rest of diffusers' DiT classes), each where the installed diffusers has
# the model class.
ALL_FAMILIES: tuple[str, ...] = tuple(_BASE)
FAMILIES: tuple[str, ...] = tuple(s.name for s in _CURATED if hasattr(diffusers, s.class_name))
MORE_FAMILIES_HERE: tuple[str, ...] = tuple(s.name for s in MORE_FAMILIES if hasattr(diffusers, s.class_name))
# the variants ("family[tag]"), all and those this diffusers can build
ALL_VARIANTS: tuple[str, ...] = tuple(s.name for s in _VARIANT_SPECS)
VARIANTS_HERE: tuple[str, ...] = tuple(s.name for s in _VARIANT_SPECS if hasattr(diffusers, s.class_name))


@dataclasses.dataclass
class ZooModel:
    """A built zoo model. ``make_inputs(batch=1, variant="default", seed=0)`` returns the exact keyword
    arguments of ``model.forward`` (tensors plus constants such as ``return_dict=False``)."""

    family: str
    model: torch.nn.Module
    make_inputs: Callable[..., dict]
    variants: tuple[str, ...]
    expected: dict
    pipeline_class: str | None
    overrides: dict = dataclasses.field(default_factory=dict)  # the config fields ``build`` was given


def _spec(family: str) -> FamilySpec:
    if family not in _SPECS:
        raise KeyError(f"unknown zoo family {family!r}; known families: {', '.join(ALL_FAMILIES)}")
    spec = _SPECS[family]
    if not hasattr(diffusers, spec.class_name):
        raise RuntimeError(
            f"zoo family {family!r} needs diffusers.{spec.class_name}, which diffusers {diffusers.__version__} "
            f"does not have; available families here: {', '.join(FAMILIES + MORE_FAMILIES_HERE)}"
        )
    return spec


def family_spec(family: str) -> FamilySpec:
    """The static description of ``family`` (its config, block-list and head fields); raises as :func:`build`."""
    return _spec(family)


def class_name_of(family: str) -> str:
    """The diffusers class name that ``family`` builds (whether or not this diffusers has it)."""
    if family not in _SPECS:
        raise KeyError(f"unknown zoo family {family!r}; known families: {', '.join(ALL_FAMILIES)}")
    return _SPECS[family].class_name


def model_class(family: str) -> type:
    """The diffusers model class of ``family`` (code outside the zoo builds other sizes with it, naming no class)."""
    return getattr(diffusers, _spec(family).class_name)


def config_for(family: str) -> dict:
    """The tiny config of ``family`` (keyword arguments of its diffusers model class); a fresh copy."""
    return copy.deepcopy(dict(_spec(family).config))


def group_widths(family: str, multiple: int, overrides: dict | None = None) -> dict:
    """Config fields that build ``family`` (with ``overrides``) wider, keeping its structure, so its block linears'
    widths are multiples of ``multiple`` (a quantization kind's group: int4 takes K in groups of 64 and the zoo's
    widths are 32): the head count times the least factor that makes heads x head_dim a multiple (the head width,
    and with it the rope's axes, kept), the hidden width where the class has its own field for it, and the family's
    ``width_keys`` by the same factor. ``{}`` where the width is a multiple already."""
    spec = _spec(family)
    config = config_for(family)
    config.update(overrides or {})
    if spec.tied_config is not None:
        config.update({k: v for k, v in spec.tied_config(config).items() if k not in (overrides or {})})
    heads, head_dim = spec.heads_and_head_dim(config)
    factor = int(multiple) // math.gcd(heads * head_dim, int(multiple))
    if factor == 1:
        return {}
    keys = ([spec.heads_key] if spec.heads_key in config else []) + \
        ([spec.hidden_key] if spec.hidden_key is not None else []) + list(spec.width_keys)
    return {k: config[k] * factor for k in dict.fromkeys(keys)}


def _checked_config(spec: FamilySpec, overrides: dict) -> dict:
    cls = getattr(diffusers, spec.class_name)
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(k for k in overrides if k not in params or k == "self")
    if unknown:
        valid = ", ".join(p for p in params if p != "self")
        raise TypeError(f"{spec.class_name} has no config field(s) {unknown}; valid fields: {valid}")
    config = config_for(spec.name)
    config.update(copy.deepcopy(overrides))
    if spec.tied_config is not None:  # fields tied to the overridden ones follow them, unless overridden too
        config.update({k: v for k, v in spec.tied_config(config).items() if k not in overrides})
    return config


def _expected(spec: FamilySpec, config: dict) -> dict:
    heads, head_dim = spec.heads_and_head_dim(config)
    expected = copy.deepcopy(dict(spec.expected))
    expected["block_lists"] = {path: int(config[key]) for path, key in spec.block_list_keys.items()}
    if spec.aux_list_keys:
        expected["aux_block_lists"] = {path: int(config[key]) for path, key in spec.aux_list_keys.items()}
    expected["heads"] = heads
    expected["head_dim"] = head_dim
    expected["tokens"] = {v: spec.tokens(config, sizes) for v, sizes in spec.sizes_by_variant.items()}
    return expected


def _make_inputs(spec: FamilySpec, config: dict, batch: int = 1, variant: str = "default", seed: int = 0) -> dict:
    if variant not in spec.sizes_by_variant:
        raise ValueError(f"{spec.name} has no input variant {variant!r}; variants: {tuple(spec.sizes_by_variant)}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return spec.inputs(MappingProxyType(config), batch, spec.sizes_by_variant[variant], gen)


def inputs_for(family: str, variant: str = "default", batch: int = 1, seed: int = 0, **overrides: Any) -> dict:
    """What ``build(family, **overrides).make_inputs(batch, variant, seed)`` returns, without building the model
    (the inputs depend on the config only). Every family has a ``"default"`` input set and an ``"alt_resolution"``
    one at a second size (another image grid or frame count, which classes with a ``sample_size`` in their config
    call with a positional table built in forward); ``ZooModel.variants`` lists a family's others."""
    spec = _spec(family)
    return _make_inputs(spec, _checked_config(spec, overrides), batch, variant, seed)


def _construct(cls: type, config: dict) -> torch.nn.Module:
    """``cls(**config)`` with torch's uninitialised memory filled with NaN (deterministic-algorithms mode, restored
    after): a parameter a class leaves to a checkpoint load (``torch.empty`` experts) then shows as NaN, where
    comparing two builds missed it whenever the allocator handed both the same stale bytes (ranks then built
    different weights)."""
    was_on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return cls(**config)
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)


def _init_uninitialized(model: torch.nn.Module, seed: int) -> None:
    """Draw the parameters a class leaves uninitialised (NaN after :func:`_construct`) from ``seed``, scaled by
    1/sqrt(fan-in), so every build of a family is identical (ranks build their own copy)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() and p.is_floating_point() and torch.isnan(p).any():
                fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    stale = [name for name, b in model.named_buffers() if b.is_floating_point() and torch.isnan(b).any()]
    if stale:
        raise RuntimeError(f"{type(model).__name__}: buffers {stale} are left uninitialised by the class; "
                           "the zoo cannot draw a buffer's value (give the family an after_build that sets it)")


def redraw_zero_parameters(model: torch.nn.Module, seed: int) -> list[str]:
    """Redraw every all-zero floating parameter of ``model`` in place; returns their names.

    diffusers zero-initialises gates and modulation / output projections (adaLN-Zero, PRX's ``modulation.lin``,
    Lumina-Next's ``gate``, Kandinsky 5's ``out_layer``) and most norm biases; behind a zero weight a block's
    output does not depend on what feeds it, so a check against eager cannot see a wrong rewrite there. The new
    values are ``N(0, 1/fan_in)`` (fan-in: the elements per output row; a vector's length), from a generator
    seeded by ``seed`` and walked in parameter order: every build of a family (each rank's) gets the same."""
    gen = torch.Generator().manual_seed(int(seed) + 2)
    redrawn = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.numel() and not p.any():
                fan_in = p.numel() // p.shape[0] if p.dim() > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=gen) / max(fan_in, 1) ** 0.5)
                redrawn.append(name)
    return redrawn


def build(family: str, seed: int = 0, redraw_zeros: bool = False, **overrides: Any) -> ZooModel:
    """Build the tiny ``family`` model with weights drawn from ``seed`` (fp32, CPU, eval mode).

    ``overrides`` replace config fields (e.g. ``num_layers=3``); ``expected`` and ``make_inputs``
    follow them. ``redraw_zeros``: redraw the parameters diffusers leaves all-zero
    (:func:`redraw_zero_parameters`; what ``dit-passes coverage`` builds). The global torch RNG state is left
    as it was.
    """
    spec = _spec(family)
    config = _checked_config(spec, overrides)
    cls = getattr(diffusers, spec.class_name)
    # fork_rng: seeding for the weights must not disturb the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = _construct(cls, config)
        _init_uninitialized(model, int(seed))
        if spec.after_build is not None:
            spec.after_build(model)
        if redraw_zeros:
            redraw_zero_parameters(model, int(seed))
    # diffusers builds fp32 CPU modules already; no .to(dtype), which would warn about and override
    # the classes' keep-in-fp32 lists for nothing
    model.eval()
    wrong = sorted({str(t.dtype) for t in model.state_dict().values() if t.is_floating_point()} - {"torch.float32"})
    if wrong:
        raise RuntimeError(f"{spec.class_name} built with {wrong} tensors; the zoo promises fp32 "
                           f"(is torch's default dtype changed? it is {torch.get_default_dtype()})")
    make_inputs = functools.partial(_make_inputs, spec, config)
    if spec.warm_up:
        # torch.compile directives ignored here (force_eager): Wan-Animate 2 builds its flex block mask with
        # create_block_mask(_compile=True), an Inductor compile of 3-8 CPU s in every process that builds it, for a
        # mask that takes milliseconds eagerly (the same mask: tests/test_zoo.py checks it)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(**make_inputs())
    return ZooModel(
        family=family,
        model=model,
        make_inputs=make_inputs,
        variants=tuple(spec.sizes_by_variant),
        expected=_expected(spec, config),
        pipeline_class=spec.pipeline_class,
        overrides=copy.deepcopy(dict(overrides)),
    )
