"""cache-dit's configuration files: one YAML file (or dict) for every ``enable_cache`` argument.

    cache_dit.enable_cache(pipe, **cache_dit.load_configs("config.yaml"))

The file has the reference's sections, each optional::

    cache_config:            # DBCacheConfig / DBPruneConfig fields (cache_type: DBPrune picks the latter)
      Fn_compute_blocks: 1
      residual_diff_threshold: 0.12
      enable_taylorseer: true   # calibrator keys: enable_taylorseer / enable_dmd / enable_foca and their options
      taylorseer_order: 1
    parallelism_config:      # ParallelismConfig fields; ulysses / ring / tp alias the *_size fields,
      ulysses_size: auto     # "auto": the world size over the other sizes
    attention_backend: native
    quantize_config:         # QuantizeConfig fields
      quant_type: float8_per_row

A file without any section is the reference's older flat form: the whole file is the cache section.

Stricter than the reference, by design: cache-dit's loader sets only the keys a config already has and skips
the rest (``BasicCacheConfig.update``), so a misspelt key leaves its default and nothing says so; here a key no
config knows, or a value of the wrong type, raises before any generation, naming the key and the section. For the
same reason ``reset=True`` (the reference's way to blank a config for its ``ParamsModifier``) is refused.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Optional, Tuple, Union

from ..cache.config import (CalibratorConfig, DBCacheConfig, DBPruneConfig, DMDCalibratorConfig,
                            FoCaCalibratorConfig, TaylorSeerCalibratorConfig)
from ..cache.steps_mask import steps_mask
from .configs import ParallelismConfig, QuantizeConfig

SECTIONS = ("cache_config", "parallelism_config", "attention_backend", "quantize_config")

# The calibrator keys of a cache section, per calibrator: {key: (calibrator field, the reference's default)};
# a default of ENABLE follows the calibrator's own enable key (the reference's enable_encoder_dmd).
ENABLE = object()
_CALIBRATORS = {
    "enable_taylorseer": (TaylorSeerCalibratorConfig, {
        "enable_encoder_taylorseer": ("enable_encoder_calibrator", False),
        "taylorseer_cache_type": ("calibrator_cache_type", "residual"),
        "taylorseer_order": ("taylorseer_order", 1)}),
    "enable_dmd": (DMDCalibratorConfig, {
        "enable_encoder_dmd": ("enable_encoder_calibrator", ENABLE),
        "calibrator_cache_type": ("calibrator_cache_type", "residual"),
        "dmd_history": ("dmd_history", 6), "dmd_rank": ("dmd_rank", 0), "dmd_ridge": ("dmd_ridge", 1e-8),
        "dmd_svd_precision": ("dmd_svd_precision", "medium")}),
    "enable_foca": (FoCaCalibratorConfig, {
        "enable_encoder_foca": ("enable_encoder_calibrator", False),
        "calibrator_cache_type": ("calibrator_cache_type", "residual")}),
}
CALIBRATOR_KEYS = frozenset(k for enable, (_, opts) in _CALIBRATORS.items() for k in (enable, *opts))
_SIZE_ALIASES = (("ulysses", "ulysses_size"), ("ring", "ring_size"), ("tp", "tp_size"))


def _read(path_or_dict: Union[str, Dict[str, Any]]) -> Dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    if not isinstance(path_or_dict, str):
        raise TypeError(f"expected a YAML file path (str) or a dict of settings, got {type(path_or_dict).__name__}")
    import yaml
    with open(path_or_dict) as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path_or_dict}: the file must hold a mapping of settings (sections {SECTIONS}), "
                         f"got a {type(data).__name__}")
    return data


def _check_reset(kwargs: Dict[str, Any]) -> None:
    unknown = set(kwargs) - {"reset", "check_only", "auto_parallel_size"}
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}")
    if kwargs.get("reset"):
        raise NotImplementedError("reset=True blanks a config for cache-dit's ParamsModifier, which dit_passes does "
                                  "not take: give the full settings of each transformer to its own enable_cache")


def _fields(cls: type) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown(section: str, keys, known) -> None:
    bad = sorted(set(keys) - set(known))
    if bad:
        raise ValueError(f"{section}: unknown key(s) {bad}; known: {sorted(known)}")


def _calibrator(section: Dict[str, Any]) -> Optional[CalibratorConfig]:
    enabled = [k for k in _CALIBRATORS if section.get(k)]
    if len(enabled) > 1:
        raise ValueError(f"cache_config: {enabled} are mutually exclusive (one calibrator per cache): keep one")
    # options of a calibrator whose enable key is absent: a calibrator meant and not asked for (an enable key set
    # to false keeps its options quietly, as files that toggle it do)
    named = {k for e in _CALIBRATORS if e in section for k in _CALIBRATORS[e][1]}
    stray = sorted(k for k in section if k in CALIBRATOR_KEYS and k not in _CALIBRATORS and k not in named)
    if stray:
        raise ValueError(f"cache_config: {stray} configure a calibrator the section does not enable: add "
                         f"enable_taylorseer / enable_dmd / enable_foca: true (or drop them)")
    if not enabled:
        return None
    cls, opts = _CALIBRATORS[enabled[0]]
    kwargs = {"enable_calibrator": True}
    for key, (field, default) in opts.items():
        kwargs[field] = section.get(key, True if default is ENABLE else default)
    return cls(**kwargs)


def cache_section(section: Dict[str, Any]) -> Tuple[DBCacheConfig, Optional[CalibratorConfig]]:
    """``(cache config, calibrator config)`` of one cache section (the reference's flat cache options)."""
    if not isinstance(section, dict):
        raise ValueError(f"cache_config must be a mapping of DBCacheConfig fields, got {type(section).__name__}")
    section = dict(section)
    kind = str(section.get("cache_type", "DBCache"))
    classes = {"DBCache": DBCacheConfig, "DBPrune": DBPruneConfig}
    if kind not in classes:
        raise ValueError(f"cache_config.cache_type={kind!r}: use 'DBCache' or 'DBPrune'")
    cls = classes[kind]
    _unknown("cache_config", section, set(_fields(cls)) | CALIBRATOR_KEYS)
    mask = section.get("steps_computation_mask")
    if isinstance(mask, str):  # a policy name ("fast", "medium", ...): the reference builds the mask from it
        if section.get("num_inference_steps") is None:
            raise ValueError("cache_config.steps_computation_mask given as a policy name needs num_inference_steps")
        section["steps_computation_mask"] = steps_mask(total_steps=section["num_inference_steps"],
                                                       mask_policy=mask)
    # None values keep the field's default, as the reference's update() does
    cfg = cls(**{k: v for k, v in section.items() if k in _fields(cls) and v is not None})
    return cfg, _calibrator(section)


def load_cache_config(path_or_dict: Union[str, Dict[str, Any]],
                      **kwargs: Any) -> Tuple[Optional[DBCacheConfig], Optional[CalibratorConfig]]:
    """``(cache_config, calibrator_config)``: from the ``cache_config`` section; ``(None, None)`` when the file has
    only other sections; the whole file when it has none (the flat form)."""
    _check_reset(kwargs)
    data = _read(path_or_dict)
    if "cache_config" in data:
        return cache_section(data["cache_config"])
    if any(s in data for s in SECTIONS):
        return None, None
    return cache_section(data)


def _auto_sizes(section: Dict[str, Any]) -> None:
    auto = [k for _, k in _SIZE_ALIASES if isinstance(section.get(k), str)]
    for k in auto:
        if section[k].lower() != "auto":
            raise ValueError(f"parallelism_config.{k}={section[k]!r}: use an int or 'auto'")
    if len(auto) > 1:
        raise ValueError(f"parallelism_config: only one of ulysses_size / ring_size / tp_size may be 'auto' "
                         f"(got {auto})")
    if not auto:
        return
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    others = 1
    for _, k in _SIZE_ALIASES:
        if k != auto[0] and section.get(k) is not None:
            others *= section[k]
    if world % others:
        raise ValueError(f"parallelism_config.{auto[0]}='auto': the world size {world} does not divide by the "
                         f"other sizes' product {others}")
    section[auto[0]] = world // others


def load_parallelism_config(path_or_dict: Union[str, Dict[str, Any]], **kwargs: Any) -> Any:
    """The ``parallelism_config`` section as a :class:`ParallelismConfig` (None without one; ``check_only=True``:
    whether there is one). ``ulysses`` / ``ring`` / ``tp`` alias the ``*_size`` fields; one size may be ``"auto"``:
    the world size of the initialised process group (1 without one) over the other sizes."""
    _check_reset(kwargs)
    data = _read(path_or_dict)
    if kwargs.get("check_only"):
        return "parallelism_config" in data
    if "parallelism_config" not in data:
        return None
    section = dict(data["parallelism_config"] or {})
    for alias, name in _SIZE_ALIASES:
        if alias in section:
            if name in section and section[name] != section[alias]:
                raise ValueError(f"parallelism_config: {alias}={section[alias]!r} and {name}={section[name]!r} "
                                 "disagree; give one")
            section[name] = section.pop(alias)
    known = {n for n in _fields(ParallelismConfig) if not n.startswith("_")}
    _unknown("parallelism_config", section, known)
    if kwargs.get("auto_parallel_size", True):
        _auto_sizes(section)
    return ParallelismConfig(**section)


def load_attn_backend_config(path_or_dict: Union[str, Dict[str, Any]], **kwargs: Any) -> Optional[str]:
    """The file's ``attention_backend`` (None without one)."""
    _check_reset(kwargs)
    backend = _read(path_or_dict).get("attention_backend")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"attention_backend must be a backend name (str), got {backend!r}")
    return backend


def load_quantize_config(path_or_dict: Union[str, Dict[str, Any]], **kwargs: Any) -> Optional[QuantizeConfig]:
    """The ``quantize_config`` section as a :class:`QuantizeConfig` (None without one); None values keep the
    field's default, as in the reference."""
    _check_reset(kwargs)
    data = _read(path_or_dict)
    if "quantize_config" not in data:
        return None
    section = data["quantize_config"] or {}
    _unknown("quantize_config", section, _fields(QuantizeConfig))
    return QuantizeConfig(**{k: v for k, v in section.items() if v is not None})


def load_configs(path_or_dict: Union[str, Dict[str, Any]], return_dict: bool = True, **kwargs: Any) -> Any:
    """Every section of one YAML file or dict: ``{"cache_config", "calibrator_config", "parallelism_config",
    "attention_backend", "quantize_config"}`` (``enable_cache``'s keyword arguments), or that tuple with
    ``return_dict=False``. A key no section knows raises, naming it."""
    data = _read(path_or_dict)
    if any(s in data for s in SECTIONS):
        _unknown("the configuration file", data, SECTIONS)
    cache, calibrator = load_cache_config(data, **kwargs)
    parallel = load_parallelism_config(data, **{k: v for k, v in kwargs.items() if k != "check_only"})
    attention = load_attn_backend_config(data, **kwargs)
    quantize = load_quantize_config(data, **kwargs)
    out = {"cache_config": cache, "calibrator_config": calibrator, "parallelism_config": parallel,
           "attention_backend": attention, "quantize_config": quantize}
    return out if return_dict else tuple(out.values())


def load_options(path_or_dict: Union[str, Dict[str, Any]], reset: bool = False) -> Dict[str, Any]:
    """The reference's older loader (deprecated there): ``{"cache_config", "calibrator_config"}`` of a flat cache
    section."""
    import warnings
    warnings.warn("load_options is deprecated (as in cache-dit): use load_configs", DeprecationWarning, stacklevel=2)
    cache, calibrator = load_cache_config(path_or_dict, reset=reset)
    out: Dict[str, Any] = {"cache_config": cache}
    if calibrator is not None:
        out["calibrator_config"] = calibrator
    return out
