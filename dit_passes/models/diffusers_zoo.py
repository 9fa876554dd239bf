"""Every transformer class of the installed diffusers, and the zoo families that build each.

The list comes from diffusers itself: the public names of ``diffusers.models.transformers`` that are
``ModelMixin`` subclasses. A new diffusers release with a new class shows up here by itself, as a class with
no zoo family ("no config") until one is written in ``zoo_more``. Classes that are not diffusion transformers
over latent tokens (priors, UNet sub-layers, codecs, ...) are listed in :data:`EXCLUDED` with the reason.

    rows = coverage_rows()     # [ClassRow(class_name, families=("flux", "flux[schnell]", ...), excluded=None), ...]
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

# class name -> why it is not in the DiT coverage. Only classes that are not a diffusion transformer over
# image / video / audio latent tokens; a DiT whose passes fail stays in the matrix.
EXCLUDED: MappingProxyType = MappingProxyType({
    "PriorTransformer": "unCLIP / Kandinsky-2 prior: maps CLIP text embeddings to image embeddings (no latent tokens)",
    "DualTransformer2DModel": "a pair of Transformer2DModels inside Versatile Diffusion's UNet, not a denoiser itself",
    "T5FilmDecoder": "spectrogram-continuation T5 decoder with FiLM conditioning (music pipeline), not a latent DiT",
    "Transformer2DModel": "the generic UNet attention layer (continuous / vectorized inputs); its patch-DiT uses are "
                          "DiTTransformer2DModel and PixArtTransformer2DModel, which are covered",
    "TransformerTemporalModel": "a temporal attention layer inside video UNets (AnimateDiff, SVD), not a denoiser "
                                "on its own",
    "MiniMaxMusic3RVQDepthDecoder": "an autoregressive residual-vector-quantizer depth decoder (codec tokens), not a "
                                    "diffusion transformer",
    "RFD4ProteinaTransformer": "protein-structure diffusion over residue coordinates, not image / video / audio "
                               "latents",
})


@dataclasses.dataclass(frozen=True)
class ClassRow:
    """One transformer class: the zoo families that build it (empty: no config yet) or why it is excluded."""

    class_name: str
    module: str
    families: tuple[str, ...]
    excluded: str | None = None


def transformer_classes() -> dict[str, type]:
    """Public ``ModelMixin`` classes of ``diffusers.models.transformers``, by name (sorted)."""
    import diffusers.models.transformers as transformers
    from diffusers.models.modeling_utils import ModelMixin

    names = getattr(transformers, "__all__", None) or [n for n in dir(transformers) if not n.startswith("_")]
    out = {}
    for name in sorted(names):
        try:
            obj = getattr(transformers, name)
        except (ImportError, AttributeError):  # an optional dependency missing: not exported here
            continue
        if isinstance(obj, type) and issubclass(obj, ModelMixin):
            out[name] = obj
    return out


def coverage_rows() -> list[ClassRow]:
    """One row per transformer class of this diffusers, plus one per zoo family whose class it lacks."""
    from dit_passes.models.zoo import ALL_FAMILIES, ALL_VARIANTS, class_name_of

    by_class: dict[str, list[str]] = {}
    for family in ALL_FAMILIES + ALL_VARIANTS:  # a class's variants ("flux[schnell]") after its base family
        by_class.setdefault(class_name_of(family), []).append(family)
    classes = transformer_classes()
    rows = [ClassRow(name, cls.__module__, tuple(by_class.get(name, ())), EXCLUDED.get(name))
            for name, cls in classes.items()]
    # a class the zoo knows but diffusers only exports at the top level (or no longer has) still shows
    import diffusers
    for name in sorted(set(by_class) - set(classes)):
        cls = getattr(diffusers, name, None)
        module = cls.__module__ if cls is not None else "(not in this diffusers)"
        rows.append(ClassRow(name, module, tuple(by_class[name]), None))
    return rows


__all__ = ["EXCLUDED", "ClassRow", "coverage_rows", "transformer_classes"]
