"""``QuantizeConfig.components_to_quantize``: which pipeline components a quantize config reaches, as cache-dit 1.5.3
decides, and the components besides the transformer(s) quantized through the same passes.

The rule: ``None`` quantizes the transformer(s); otherwise only the listed components, each with its own config
(:meth:`~dit_passes.frontend.configs.QuantizeConfig.component_configs`). ``"transformer"`` / ``"transformer_2"`` are
the transformers ``enable_cache`` wraps (a bare transformer is ``"transformer"``). ``"text_encoder"`` names the
pipeline's main text encoder as the reference does: ``text_encoder_2`` (FLUX's T5; not for the Hunyuan / Kandinsky
pipelines, whose second encoder is the small one), else ``text_encoder_3``, else ``vision_language_encoder`` (GLM-Image),
else ``text_encoder``; an attribute holding ``None`` is skipped (the reference would fail on it). Any other name is that
pipeline attribute; a module is found among the pipeline's components. Each such component becomes a
:class:`~dit_passes.compiled.CompiledDiT` running ``config.to_passes(component)``: its linears quantized
(``Fp8Linear`` / ``Int8Linear`` on the captured graph; a text encoder has no ``_repeated_blocks``, so every linear but
``exclude_layers``' substrings, the reference's rule). A component the pipeline does not call as ``module(...)`` (a
VAE: ``vae.decode``) is refused.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .configs import QuantizeConfig

TRANSFORMER_NAMES = ("transformer", "transformer_2")
# the reference's order for "text_encoder": the pipeline's largest text encoder first
_MAIN_TEXT_ENCODER = ("text_encoder_2", "text_encoder_3", "vision_language_encoder", "text_encoder")
_SECOND_ENCODER_IS_SMALL = ("Hunyuan", "Kandinsky")  # pipeline-name prefixes whose text_encoder_2 is not the main one


def plan(pipe_or_module: Any, q: Optional[QuantizeConfig]
         ) -> Tuple[Dict[str, QuantizeConfig], List[Tuple[str, QuantizeConfig]]]:
    """``({transformer attribute: config}, [(other component's attribute, config)])`` for ``q`` on a pipeline, or on a
    bare transformer (its key ``"transformer"``). Every entry is resolved and checked here, before anything changes."""
    if q is None:
        return {}, []
    if q.components_to_quantize is None:
        return {name: q for name in TRANSFORMER_NAMES}, []
    pipe = None if isinstance(pipe_or_module, torch.nn.Module) else pipe_or_module
    transformers: Dict[str, QuantizeConfig] = {}
    others: List[Tuple[str, QuantizeConfig]] = []
    for component, cfg in q.component_configs():
        if component is pipe_or_module:  # the bare transformer given as a module
            component = "transformer"
        if isinstance(component, str) and component in TRANSFORMER_NAMES:
            transformers[component] = cfg
            continue
        if pipe is None:
            raise ValueError(f"QuantizeConfig.components_to_quantize: {component!r} is not the transformer: pass the "
                             "pipeline, enable_cache(pipe, ...), to quantize its other components")
        attr = resolve(pipe, component)
        if attr in TRANSFORMER_NAMES:  # a transformer given as a module
            transformers[attr] = cfg
        else:
            others.append((attr, cfg))
    attrs = [a for a, _ in others]
    if len(set(attrs)) != len(attrs):
        raise ValueError(f"QuantizeConfig.components_to_quantize names one component twice: {attrs}")
    return transformers, others


def _main_text_encoder(pipe: Any) -> str:
    order = _MAIN_TEXT_ENCODER
    if type(pipe).__name__.startswith(_SECOND_ENCODER_IS_SMALL):
        order = tuple(a for a in order if a != "text_encoder_2")
    for attr in order:
        if isinstance(getattr(pipe, attr, None), torch.nn.Module):
            return attr
    raise ValueError(f"QuantizeConfig.components_to_quantize: 'text_encoder': {type(pipe).__name__} holds no text "
                     f"encoder (looked for {', '.join(order)})")


def resolve(pipe: Any, component: Any) -> str:
    """The pipeline attribute that holds ``component`` (a name, or the module itself)."""
    if isinstance(component, str):
        attr = _main_text_encoder(pipe) if component == "text_encoder" else component
        if not isinstance(getattr(pipe, attr, None), torch.nn.Module):
            raise ValueError(f"QuantizeConfig.components_to_quantize: {type(pipe).__name__}.{attr} is not a module "
                             f"({type(getattr(pipe, attr, None)).__name__}); components: "
                             f"{sorted(getattr(pipe, 'components', {}))}")
    else:
        found = [k for k, v in getattr(pipe, "components", {}).items() if v is component]
        if not found:
            raise ValueError(f"QuantizeConfig.components_to_quantize: the {type(component).__name__} given is not a "
                             f"component of this {type(pipe).__name__}")
        attr = found[0]
    if callable(getattr(getattr(pipe, attr), "decode", None)):
        raise NotImplementedError(f"QuantizeConfig.components_to_quantize: {attr} is a VAE, which the pipeline calls "
                                  "through .decode(), not as module(...): quantize text encoders and transformers")
    return attr


def quantize_components(pipe: Any, others: List[Tuple[str, QuantizeConfig]], keep_original: bool,
                        skip: Sequence[torch.nn.Module] = ()) -> Tuple[List[Tuple[str, Any]], Dict[int, list]]:
    """Replace each of ``others`` (from :func:`plan`) on ``pipe`` by its quantized CompiledDiT. Returns
    ``[(attribute, original)]`` (what ``disable_cache`` puts back) and, for the modules in ``skip`` (parallelised by
    the caller, who appends these passes to theirs), ``{id(module): quantization passes}``."""
    from .. import compile_dit

    replaced: List[Tuple[str, Any]] = []
    deferred: Dict[int, list] = {}
    for attr, cfg in others:
        module = getattr(pipe, attr)
        if any(module is m for m in skip):
            deferred[id(module)] = cfg.to_passes(module)
            continue
        setattr(pipe, attr, compile_dit(module, passes=cfg.to_passes(module), keep_original=keep_original))
        replaced.append((attr, module))
    return replaced, deferred
