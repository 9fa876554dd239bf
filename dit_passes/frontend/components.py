"""``QuantizeConfig.components_to_quantize``: which pipeline components a quantize config reaches, as cache-dit 1.5.3
decides, and the components besides the transformer(s) quantized through the same passes.

The rule: ``None`` quantizes the transformer(s); otherwise only the listed components, each with its own config
(:meth:`~dit_passes.frontend.configs.QuantizeConfig.component_configs`). ``"transformer"`` / ``"transformer_2"`` are
the transformers ``enable_cache`` wraps (a bare transformer is ``"transformer"``). ``"text_encoder"`` names the
pipeline's main text encoder (:func:`main_text_encoder`): ``text_encoder_2`` (FLUX's T5, SD3's CLIP-G), else
``text_encoder_3``, else ``vision_language_encoder``, else ``text_encoder`` (the reference's order), where a
``text_encoder_2`` narrower than ``text_encoder`` is passed over (the reference names the pipelines whose second
encoder is the small one; here the widths decide); an attribute holding ``None`` is skipped (the reference would fail
on it). Any other name is that pipeline attribute; a module is found among the pipeline's components.
``extra_parallel_modules`` names are resolved by the same rules (:func:`extra_modules`). Each such component becomes a
:class:`~dit_passes.compiled.CompiledDiT` running ``config.to_passes(component)``: its linears quantized
(``Fp8Linear`` / ``Int8Linear`` on the captured graph; a text encoder has no ``_repeated_blocks``, so every linear but
``exclude_layers``' substrings, the reference's rule). A VAE, which the pipeline calls through ``vae.decode`` /
``vae.encode``, becomes a :class:`~dit_passes.passes.vae_parallel.VAEGraphs`: each call captured and its linears
(the mid-block attention's) quantized the same way.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .configs import QuantizeConfig

logger = logging.getLogger("dit_passes")

TRANSFORMER_NAMES = ("transformer", "transformer_2")
# the reference's order for "text_encoder": the pipeline's largest text encoder first
_MAIN_TEXT_ENCODER = ("text_encoder_2", "text_encoder_3", "vision_language_encoder", "text_encoder")


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


def _width(module: torch.nn.Module) -> Optional[int]:
    """An encoder's hidden size from its config (``hidden_size``, T5's ``d_model``, a multimodal model's
    ``text_config.hidden_size``); None when it declares none."""
    config = getattr(module, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        for key in ("hidden_size", "d_model"):
            value = getattr(holder, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _second_is_minor(pipe: Any, first: torch.nn.Module, second: torch.nn.Module) -> bool:
    """Whether ``text_encoder_2`` is the secondary encoder beside ``text_encoder``. The reference excludes it by
    pipeline name where the second encoder is the small one (a CLIP / ByT5 beside a large LLM encoder); structurally:
    it is narrower than ``text_encoder``, or the transformer's ``cross_attention_dim`` (the width of the context
    it attends to) is ``text_encoder``'s and not its. Equal widths keep the reference's order (``text_encoder_2``).
    Widths unknown: the parameter counts compare instead."""
    w1, w2 = _width(first), _width(second)
    if w1 is None or w2 is None:
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        return count(first) > count(second)
    if w1 > w2:
        return True
    transformer = getattr(pipe, "transformer", None)
    context = getattr(getattr(transformer, "config", None), "cross_attention_dim", None)
    return context == w1 != w2


def main_text_encoder(pipe: Any) -> str:
    """The attribute holding ``pipe``'s main text encoder: the first module among ``text_encoder_2``,
    ``text_encoder_3``, ``vision_language_encoder``, ``text_encoder`` (the reference's order), ``text_encoder_2``
    passed over when it is the secondary one (:func:`_second_is_minor`)."""
    found = {a: m for a in _MAIN_TEXT_ENCODER if isinstance(m := getattr(pipe, a, None), torch.nn.Module)}
    if "text_encoder_2" in found and "text_encoder" in found \
            and _second_is_minor(pipe, found["text_encoder"], found["text_encoder_2"]):
        del found["text_encoder_2"]
    if not found:
        raise ValueError(f"'text_encoder': {type(pipe).__name__} holds no text encoder (looked for "
                         f"{', '.join(_MAIN_TEXT_ENCODER)})")
    return next(iter(found))


def extra_modules(pipe: Any, entries: Sequence[Any]) -> List[torch.nn.Module]:
    """``ParallelismConfig.extra_parallel_modules`` as modules, the reference's rule: a module is kept; a name is
    that pipeline attribute, ``"text_encoder"`` the main text encoder (:func:`main_text_encoder`); a name the
    pipeline lacks (or holding None) is skipped with a warning, as the reference does."""
    out: List[torch.nn.Module] = []
    for entry in entries:
        if isinstance(entry, torch.nn.Module):
            out.append(entry)
            continue
        if not isinstance(entry, str):
            raise TypeError(f"ParallelismConfig.extra_parallel_modules: {entry!r} is neither a module nor a pipeline "
                            "component name")
        try:
            attr = main_text_encoder(pipe) if entry == "text_encoder" else entry
        except ValueError:
            attr = entry
        module = getattr(pipe, attr, None)
        if isinstance(module, torch.nn.Module):
            out.append(module)
        else:
            logger.warning("ParallelismConfig.extra_parallel_modules: %s has no module %r; skipped (components: %s)",
                           type(pipe).__name__, attr, sorted(getattr(pipe, "components", {})))
    return out


_named_modules = extra_modules  # parse_extra_modules' argument of that name (cache-dit's) hides it


def parse_extra_modules(pipe_or_adapter: Any, extra_modules: Sequence[Any],
                        skip_text_encoder_override: bool = False) -> List[torch.nn.Module]:
    """cache-dit's ``parse_extra_modules``: ``extra_modules`` (names or modules) as the pipeline's modules, by
    :func:`extra_modules`'s rules. ``pipe_or_adapter`` is the pipeline, or an object holding it as ``.pipe``
    (cache-dit's BlockAdapter); without one, or with no names, the answer is empty. ``"text_encoder"`` is the main
    text encoder (Flux's T5 ``text_encoder_2``) unless ``skip_text_encoder_override``, which takes the attribute as
    named."""
    pipe = pipe_or_adapter if hasattr(pipe_or_adapter, "components") else getattr(pipe_or_adapter, "pipe", None)
    if not extra_modules or pipe is None:
        return []
    literal = getattr(pipe, "text_encoder", None) if skip_text_encoder_override else None
    entries = [literal if entry == "text_encoder" and isinstance(literal, torch.nn.Module) else entry
               for entry in extra_modules]
    return _named_modules(pipe, entries)


def resolve(pipe: Any, component: Any) -> str:
    """The pipeline attribute that holds ``component`` (a name, or the module itself)."""
    if isinstance(component, str):
        try:
            attr = main_text_encoder(pipe) if component == "text_encoder" else component
        except ValueError as e:
            raise ValueError(f"QuantizeConfig.components_to_quantize: {e}") from None
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
    return attr


def quantize_components(pipe: Any, others: List[Tuple[str, QuantizeConfig]], keep_original: bool,
                        skip: Sequence[torch.nn.Module] = ()) -> Tuple[List[Tuple[str, Any]], Dict[int, Any]]:
    """Replace each of ``others`` (from :func:`plan`) on ``pipe`` by its quantized CompiledDiT (a VAE: its
    VAEGraphs). Returns ``[(attribute, original)]`` (what ``disable_cache`` puts back) and, for the modules in
    ``skip`` (parallelised by the caller, who appends these passes to theirs), ``{id(module): a callable building
    its quantization passes}``."""
    from .. import compile_dit
    from ..passes.vae_parallel import VAEGraphs

    replaced: List[Tuple[str, Any]] = []
    deferred: Dict[int, Any] = {}
    for attr, cfg in others:
        module = getattr(pipe, attr)
        build = functools.partial(cfg.to_passes, module)  # a VAE builds them for each graph it captures
        if any(module is m for m in skip):
            deferred[id(module)] = build
            continue
        quantized = VAEGraphs(module, build) if _is_vae(module) else \
            compile_dit(module, passes=build(), keep_original=keep_original)
        setattr(pipe, attr, quantized)
        replaced.append((attr, module))
    return replaced, deferred


def _is_vae(module: torch.nn.Module) -> bool:
    """A module the pipeline calls through ``decode`` / ``encode`` (a VAE), not as ``module(...)``."""
    return callable(getattr(module, "decode", None))
