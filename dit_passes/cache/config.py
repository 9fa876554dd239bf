"""Residual-cache configuration: cache-dit 1.5.3's ``DBCacheConfig`` / ``DBPruneConfig`` and its calibrator
configs (``TaylorSeerCalibratorConfig``, ``FoCaCalibratorConfig``, ``DMDCalibratorConfig``).

Same field names, defaults and ``strify()`` tags as the reference (``cache_dit/caching/cache_contexts/
cache_config.py`` and ``calibrators/__init__.py``), so a user's existing config carries over. Unlike the
reference, values are validated when the config is built: the reference accepts nonsense (negative caps,
a mask of arbitrary objects) and fails, or silently does something else, mid-generation.

Fields the reference has beyond the brief's list, and what we do with them:

* ``cache_type``: ``"DBCache"`` here; ``"DBPrune"`` is :class:`DBPruneConfig`'s (``NONE`` is rejected).
* ``force_refresh_step_hint`` / ``force_refresh_step_policy``: implemented (the state is reset at that call
  index, once or every ``hint`` calls), except together with ``enable_separate_cfg=True``: the reference
  counts the hint in transformer calls across both CFG branches and can flip the branch parity at an odd
  hint, which a per-branch state cannot reproduce, so that combination is rejected.
* ``ExtraCacheConfig`` (``l1_hidden_states_diff_threshold``, ``important_condition_threshold``,
  ``downsample_factor``) is not a ``DBCacheConfig`` field in the reference (users are told never to set it)
  and is not supported: its defaults (None / 0.0 / 1) are what we implement.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Optional

_POLICIES = ("dynamic", "static")
_REFRESH_POLICIES = ("once", "repeat")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cache_type_name(v: Any) -> str:
    # The reference stores a CacheType enum whose str() is its value ("DBCache"); accept it or the string.
    return v if isinstance(v, str) else str(getattr(v, "value", v))


@dataclasses.dataclass
class DBCacheConfig:
    """Dual Block Cache settings (reference field order and defaults). See the module docstring for scope.

    ``residual_diff_threshold``: cache when the relative L1 diff of the Fn residual is below it; ``<= 0``
    never caches, ``>= 1`` always caches once a residual is stored. ``max_cached_steps`` /
    ``max_continuous_cached_steps``: ``-1`` means unlimited. ``steps_computation_mask``: one 0/1 per step,
    1 = must compute. ``enable_separate_cfg``: ``True`` keeps the reference's call parity (odd calls are the CFG
    branch; refused at the second call where the first two ran at different timesteps), ``False`` one state for
    every call, ``None`` (the default; the reference resolves it from a per-pipeline table) tells the branches apart
    from the calls: a call at the previous call's timestep with the same latents is the next branch of that step,
    with its own state (:mod:`dit_passes.cache.branches`). Under ``None`` each branch counts its own steps, so
    ``force_refresh_step_hint`` and DBPrune's dynamic threshold act per branch, where the reference (True from its
    table) counts the hint in calls and reads the other branch's diffs.
    """

    cache_type: Any = "DBCache"
    Fn_compute_blocks: int = 8
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    max_accumulated_residual_diff_threshold: Optional[float] = None
    max_warmup_steps: int = 8
    warmup_interval: int = 1
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = -1
    enable_separate_cfg: Optional[bool] = None
    cfg_compute_first: bool = False
    cfg_diff_compute_separate: bool = True
    num_inference_steps: Optional[int] = None
    steps_computation_mask: Optional[List[int]] = None
    steps_computation_policy: str = "dynamic"
    force_refresh_step_hint: Optional[int] = None
    force_refresh_step_policy: str = "once"

    CACHE_TYPE: ClassVar[str] = "DBCache"  # the cache_type this class accepts

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -------------------------------------------------------------------------------
    def validate(self) -> "DBCacheConfig":
        """Raise ``ValueError`` / ``TypeError`` naming the offending field and the accepted values."""
        if _cache_type_name(self.cache_type) != self.CACHE_TYPE:
            raise ValueError(f"{type(self).__name__}.cache_type={self.cache_type!r}: this class takes "
                             f"only {self.CACHE_TYPE!r} (use DBCacheConfig for DBCache, DBPruneConfig for DBPrune; "
                             f"NONE is not implemented); drop the field or set it to {self.CACHE_TYPE!r}")

        def need_int(name: str, lo: int, hint: str) -> None:
            v = getattr(self, name)
            if not _is_int(v):
                raise TypeError(f"DBCacheConfig.{name} must be an int, got {v!r} ({type(v).__name__})")
            if v < lo:
                raise ValueError(f"DBCacheConfig.{name}={v} is out of range: {hint}")

        need_int("Fn_compute_blocks", 1, "the first n blocks provide the change indicator, so n must be >= 1")
        need_int("Bn_compute_blocks", 0, "must be >= 0 (0 = no trailing blocks always run)")
        need_int("max_warmup_steps", 0, "must be >= 0")
        need_int("warmup_interval", 1, "must be >= 1 (1 = every warm-up step computes)")
        need_int("max_cached_steps", -1, "use -1 for unlimited or a count >= 0")
        need_int("max_continuous_cached_steps", -1, "use -1 for unlimited or a count >= 0")

        if not _is_number(self.residual_diff_threshold):
            raise TypeError(f"DBCacheConfig.residual_diff_threshold must be a Python float, got "
                            f"{type(self.residual_diff_threshold).__name__} (pass float(t) for a tensor)")
        acc = self.max_accumulated_residual_diff_threshold
        if acc is not None and (not _is_number(acc) or acc < 0):
            raise ValueError(f"DBCacheConfig.max_accumulated_residual_diff_threshold={acc!r}: use None "
                             f"(disabled) or a float >= 0")
        for name in ("cfg_compute_first", "cfg_diff_compute_separate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DBCacheConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.enable_separate_cfg is not None and not isinstance(self.enable_separate_cfg, bool):
            raise TypeError(f"DBCacheConfig.enable_separate_cfg must be None or a bool, got "
                            f"{self.enable_separate_cfg!r}")
        if self.enable_separate_cfg and self.cfg_diff_compute_separate and self.cfg_compute_first:
            # The reference asserts the same (cache_context.py, CachedContext.__post_init__).
            raise ValueError("DBCacheConfig: cfg_compute_first=True is not allowed with enable_separate_cfg=True "
                             "and cfg_diff_compute_separate=True; set cfg_compute_first=False")

        n = self.num_inference_steps
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"DBCacheConfig.num_inference_steps={n!r}: use None or an int >= 1")

        if self.steps_computation_policy not in _POLICIES:
            raise ValueError(f"DBCacheConfig.steps_computation_policy={self.steps_computation_policy!r}: "
                             f"must be one of {_POLICIES}")
        mask = self.steps_computation_mask
        if mask is not None:
            if not isinstance(mask, (list, tuple)) or len(mask) == 0:
                raise ValueError(f"DBCacheConfig.steps_computation_mask must be a non-empty list of 0/1 "
                                 f"(1 = compute); got {mask!r}. Build one with steps_mask(total_steps=N)")
            bad = [(i, m) for i, m in enumerate(mask) if not _is_int(m) or m not in (0, 1)]
            if bad:
                raise ValueError(f"DBCacheConfig.steps_computation_mask must hold only the ints 0 and 1; "
                                 f"bad entries (index, value): {bad[:5]}")
            if n is not None and len(mask) != n:
                raise ValueError(f"DBCacheConfig.steps_computation_mask has {len(mask)} entries but "
                                 f"num_inference_steps={n}; give one entry per step")
            if self.steps_computation_policy == "static" and mask[0] == 0:
                # The reference would "cache" step 0 with nothing stored (an assertion in apply_cache).
                raise ValueError("DBCacheConfig.steps_computation_mask[0] is 0 with the 'static' policy: step 0 "
                                 "has nothing to reuse; the mask must start with 1")
            self.steps_computation_mask = list(mask)

        hint = self.force_refresh_step_hint
        if hint is not None:
            if not _is_int(hint) or hint < 1:
                raise ValueError(f"DBCacheConfig.force_refresh_step_hint={hint!r}: use None or an int >= 1")
            if self.enable_separate_cfg:
                raise ValueError("DBCacheConfig.force_refresh_step_hint is not supported with "
                                 "enable_separate_cfg=True (the reference counts it over both CFG branches' "
                                 "calls); call CacheContexts.new_generation() at the refresh point instead")
        if self.force_refresh_step_policy not in _REFRESH_POLICIES:
            raise ValueError(f"DBCacheConfig.force_refresh_step_policy={self.force_refresh_step_policy!r}: must be "
                             f"one of {_REFRESH_POLICIES}")
        return self

    def never_caches(self) -> Optional[str]:
        """Why no step can ever be cached under this config (None: some can): the settings that rule out every step
        whatever the residuals do. A cache pass says so rather than run a branch that never skips."""
        mask = self.steps_computation_mask
        if self.max_cached_steps == 0:
            return "max_cached_steps=0 caches no step"
        if mask is not None and all(m == 1 for m in mask):
            return "steps_computation_mask computes every step (no 0 in it)"
        n = self.num_inference_steps if mask is None else len(mask)
        if n is not None and self.warmup_interval == 1 and self.warmup_limit() >= n:
            return f"the warm-up ({self.warmup_limit()} steps) covers all {n} steps"
        static_zeros = mask is not None and self.steps_computation_policy == "static"
        if self.residual_diff_threshold <= 0 and not static_zeros:
            return (f"residual_diff_threshold={self.residual_diff_threshold}: a residual diff is never below it "
                    "(cache-dit caches a step when the diff is below the threshold)")
        return None

    # -- derived values used by the decision layer ------------------------------------------------
    def warmup_limit(self) -> int:
        """Upper end of the warm-up range: with a mask, cut to the mask's leading run of 1s (reference rule)."""
        if self.steps_computation_mask is None:
            return self.max_warmup_steps
        lead = 0
        for m in self.steps_computation_mask:
            if m != 1:
                break
            lead += 1
        return min(self.max_warmup_steps, lead)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def strify(self) -> str:
        """The reference's tag, e.g. ``DBCache_F8B0_W8I1M0MC0_R0.08`` (+ ``_SCM..._policy``, ``_N``, ``_FR``,
        ``_CFG`` suffixes when those fields are set)."""
        tag = (f"{_cache_type_name(self.cache_type)}_F{self.Fn_compute_blocks}B{self.Bn_compute_blocks}_"
               f"W{self.max_warmup_steps}I{self.warmup_interval}M{max(0, self.max_cached_steps)}"
               f"MC{max(0, self.max_continuous_cached_steps)}_R{self.residual_diff_threshold}")
        if self.steps_computation_mask is not None:
            tag += "_SCM" + "".join(str(m) for m in self.steps_computation_mask) + f"_{self.steps_computation_policy}"
        if self.num_inference_steps is not None:
            tag += f"_N{self.num_inference_steps}"
        if self.force_refresh_step_hint is not None:
            tag += f"_FR{self.force_refresh_step_hint}_{self.force_refresh_step_policy}"
        if self.enable_separate_cfg is not None:
            tag += f"_CFG{int(self.enable_separate_cfg)}"
        return tag


@dataclasses.dataclass
class DBPruneConfig(DBCacheConfig):
    """cache-dit 1.5.3's ``DBPruneConfig`` (dynamic block pruning; ``cache_contexts/prune_config.py``): the
    DBCache fields and defaults, plus the prune-threshold controls below. Every block but the first
    ``Fn_compute_blocks``, the last ``Bn_compute_blocks`` and ``non_prune_block_ids`` may be skipped on its
    own (its stored residual reused) when its input barely changed since it last ran.

    ``enable_dynamic_prune_threshold``: the threshold of a block is raised to ``mean * relax_ratio`` of the
    positive diffs among the first five recorded this step, while that stays below
    ``max_dynamic_prune_threshold`` (None: twice ``residual_diff_threshold``). ``force_reduce_calibrator_vram``
    only matters with a calibrator: the decision then compares every 4th channel of the block inputs (the
    reference's ``downsample_factor`` of 4). Not supported (refused when the cache
    is built): ``enable_separate_cfg=True`` together with the dynamic threshold or with
    ``cfg_diff_compute_separate=False`` (the reference reads the other branch's list of diffs there, or
    compares a list with a float).
    """

    cache_type: Any = "DBPrune"
    enable_dynamic_prune_threshold: bool = False
    max_dynamic_prune_threshold: Optional[float] = None
    dynamic_prune_threshold_relax_ratio: float = 1.25
    non_prune_block_ids: List[int] = dataclasses.field(default_factory=list)
    force_reduce_calibrator_vram: bool = False

    CACHE_TYPE: ClassVar[str] = "DBPrune"

    def validate(self) -> "DBPruneConfig":
        super().validate()
        for name in ("enable_dynamic_prune_threshold", "force_reduce_calibrator_vram"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DBPruneConfig.{name} must be a bool, got {getattr(self, name)!r}")
        cap = self.max_dynamic_prune_threshold
        if cap is not None and not _is_number(cap):
            raise TypeError(f"DBPruneConfig.max_dynamic_prune_threshold must be None or a float, got {cap!r}")
        if not _is_number(self.dynamic_prune_threshold_relax_ratio):
            raise TypeError("DBPruneConfig.dynamic_prune_threshold_relax_ratio must be a float, got "
                            f"{self.dynamic_prune_threshold_relax_ratio!r}")
        ids = self.non_prune_block_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"DBPruneConfig.non_prune_block_ids must be a list of block indices >= 0, got {ids!r}")
        self.non_prune_block_ids = list(ids)
        if self.enable_separate_cfg and (self.enable_dynamic_prune_threshold or not self.cfg_diff_compute_separate):
            raise ValueError("DBPruneConfig: enable_separate_cfg=True is supported only with "
                             "enable_dynamic_prune_threshold=False and cfg_diff_compute_separate=True (the "
                             "reference's CFG branch reads the other branch's diffs there)")
        return self

    def never_caches(self) -> Optional[str]:
        """As DBCacheConfig's, but the dynamic threshold raises a block's threshold from the diffs before it, so a
        threshold of 0 may still prune with it."""
        reason = super().never_caches()
        if reason is not None and reason.startswith("residual_diff_threshold") and self.enable_dynamic_prune_threshold:
            return None
        return reason

    def prunable(self, num_blocks: int) -> List[int]:
        """The blocks that may be pruned: all but the first Fn, the last Bn and ``non_prune_block_ids``."""
        keep = set(range(min(self.Fn_compute_blocks, num_blocks)))
        keep |= set(range(num_blocks - min(self.Bn_compute_blocks, num_blocks), num_blocks))
        keep |= set(self.non_prune_block_ids)
        return [i for i in range(num_blocks) if i not in keep]

    def strify(self) -> str:
        """The reference's tag, e.g. ``DBPrune_F8B0_W8I1M0MC0_R0.08`` (no suffixes, as the reference)."""
        return (f"{_cache_type_name(self.cache_type)}_F{self.Fn_compute_blocks}B{self.Bn_compute_blocks}_"
                f"W{self.max_warmup_steps}I{self.warmup_interval}M{max(0, self.max_cached_steps)}"
                f"MC{max(0, self.max_continuous_cached_steps)}_R{self.residual_diff_threshold}")


_CALIBRATOR_CLASSES = ("TaylorSeerCalibratorConfig: 'taylorseer', FoCaCalibratorConfig: 'foca', "
                       "DMDCalibratorConfig: 'dmd'")


@dataclasses.dataclass
class CalibratorConfig:
    """The fields every cache-dit calibrator config has (``calibrators/__init__.py``'s ``CalibratorConfig``); use
    a subclass. ``enable_calibrator`` applies to the image stream (stream 0), ``enable_encoder_calibrator`` to the
    other streams. ``calibrator_cache_type``: ``"residual"`` predicts the middle blocks' residual (added to the
    Fn output on a cached step), ``"hidden_states"`` predicts their output directly. ``calibrator_kwargs``: the
    reference passes them to its calibrator's constructor, under the keys its fields set (so a field wins); a key
    is taken where it acts as there (:attr:`CALIBRATOR_KWARGS`: set by a field, or with the value that is ours)
    and refused otherwise, naming it."""

    enable_calibrator: bool = False
    enable_encoder_calibrator: bool = False
    calibrator_type: str = ""
    calibrator_cache_type: str = "residual"
    calibrator_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    CALIBRATOR_TYPE: ClassVar[str] = ""  # the calibrator_type a subclass takes
    # calibrator_kwargs keys taken: key -> None (a field sets it, as the reference's to_kwargs) or (the one value
    # taken, why)
    CALIBRATOR_KWARGS: ClassVar[Dict[str, Any]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def _check_calibrator_kwargs(self) -> None:
        name = type(self).__name__
        for key, value in self.calibrator_kwargs.items():
            if key not in self.CALIBRATOR_KWARGS:
                raise ValueError(f"{name}.calibrator_kwargs[{key!r}]: not a setting of this calibrator here (taken: "
                                 f"{sorted(self.CALIBRATOR_KWARGS) or 'none'}); set its fields instead")
            fixed = self.CALIBRATOR_KWARGS[key]
            if fixed is not None and value != fixed[0]:
                raise ValueError(f"{name}.calibrator_kwargs[{key!r}]={value!r}: only {fixed[0]!r} is taken "
                                 f"({fixed[1]}); drop the key")

    def validate(self) -> None:
        name = type(self).__name__
        if self.calibrator_type != self.CALIBRATOR_TYPE or not self.CALIBRATOR_TYPE:
            raise ValueError(f"{name}.calibrator_type={self.calibrator_type!r}: this class takes only "
                             f"{self.CALIBRATOR_TYPE!r}; one class per calibrator ({_CALIBRATOR_CLASSES})")
        if self.calibrator_cache_type not in ("residual", "hidden_states"):
            raise ValueError(f"{name}.calibrator_cache_type={self.calibrator_cache_type!r}: must be 'residual' or "
                             f"'hidden_states'")
        for field in ("enable_calibrator", "enable_encoder_calibrator"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{name}.{field} must be a bool")
        if not isinstance(self.calibrator_kwargs, dict):
            raise TypeError(f"{name}.calibrator_kwargs must be a dict")
        self._check_calibrator_kwargs()

    def stream_enabled(self, stream: int) -> bool:
        """Whether stream ``stream`` (0 = image, >= 1 = encoder) is predicted by the calibrator."""
        return self.enable_calibrator if stream == 0 else self.enable_encoder_calibrator

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TaylorSeerCalibratorConfig(CalibratorConfig):
    """cache-dit's TaylorSeer calibrator settings (same fields and defaults): the ladder of finite differences
    of order ``taylorseer_order`` (:mod:`dit_passes.cache.taylorseer`)."""

    enable_calibrator: bool = True
    enable_encoder_calibrator: bool = True
    calibrator_type: str = "taylorseer"
    taylorseer_order: int = 1

    CALIBRATOR_TYPE: ClassVar[str] = "taylorseer"
    CALIBRATOR_KWARGS: ClassVar[Dict[str, Any]] = {
        "n_derivatives": None,  # taylorseer_order sets it
        **{k: (1, "it feeds cache-dit's calibrator's own should_compute() schedule, which its DBCache never calls; "
                  "DBCacheConfig.max_warmup_steps / max_cached_steps / steps_computation_mask pick the computed "
                  "steps") for k in ("max_warmup_steps", "skip_interval_steps")}}

    def validate(self) -> None:
        super().validate()
        if not _is_int(self.taylorseer_order) or self.taylorseer_order < 0:
            raise ValueError(f"TaylorSeerCalibratorConfig.taylorseer_order={self.taylorseer_order!r}: use an "
                             f"int >= 0 (1 = first-order Taylor)")

    def strify(self, details: bool = False) -> str:
        if not self.taylorseer_order:
            return "NONE"
        return f"TaylorSeer_O({self.taylorseer_order})" if details else f"T1O{self.taylorseer_order}"


@dataclasses.dataclass
class FoCaCalibratorConfig(CalibratorConfig):
    """cache-dit's FoCa calibrator (Forecast then Calibrate: a BDF2 predictor with a Heun corrector anchored to the
    last computed step, :mod:`dit_passes.cache.foca`); no parameters of its own."""

    enable_calibrator: bool = True
    enable_encoder_calibrator: bool = True
    calibrator_type: str = "foca"

    CALIBRATOR_TYPE: ClassVar[str] = "foca"

    def strify(self, details: bool = False) -> str:
        return "FoCa"


@dataclasses.dataclass
class DMDCalibratorConfig(CalibratorConfig):
    """cache-dit's DMD calibrator (Dynamic Mode Decomposition: an exponential-basis forecast fitted to the last
    ``dmd_history`` computed values, :mod:`dit_passes.cache.dmd`); same fields and defaults. ``dmd_rank``: the SVD
    truncation rank (0: from the spectrum); ``dmd_ridge``: added to the kept singular values; ``dmd_svd_precision``:
    "medium" (LAPACK's default SVD), "high" (the gesvd driver on CUDA, else as medium), "low" (a randomized SVD, one
    power iteration, its start drawn from a CPU generator seeded 0 as the reference does on CPU)."""

    enable_calibrator: bool = True
    enable_encoder_calibrator: bool = True
    calibrator_type: str = "dmd"
    dmd_history: int = 6
    dmd_rank: int = 0
    dmd_ridge: float = 1e-8
    dmd_svd_precision: str = "medium"

    CALIBRATOR_TYPE: ClassVar[str] = "dmd"
    CALIBRATOR_KWARGS: ClassVar[Dict[str, Any]] = {  # the fields set history / rank / ridge / svd_precision
        "history": None, "rank": None, "ridge": None, "svd_precision": None,
        "n_derivatives": (1, "the forecast's fallback before enough snapshots is the first-order Taylor step here")}

    def validate(self) -> None:
        super().validate()
        if not _is_int(self.dmd_history) or self.dmd_history < 1:
            raise ValueError(f"DMDCalibratorConfig.dmd_history={self.dmd_history!r}: use an int >= 1 (5-6 typical)")
        if not _is_int(self.dmd_rank) or self.dmd_rank < 0:
            raise ValueError(f"DMDCalibratorConfig.dmd_rank={self.dmd_rank!r}: use an int >= 0 (0: from the spectrum)")
        if not isinstance(self.dmd_ridge, (int, float)) or isinstance(self.dmd_ridge, bool) or self.dmd_ridge < 0:
            raise ValueError(f"DMDCalibratorConfig.dmd_ridge={self.dmd_ridge!r}: use a float >= 0")
        if self.dmd_svd_precision not in ("low", "medium", "high"):
            raise ValueError(f"DMDCalibratorConfig.dmd_svd_precision={self.dmd_svd_precision!r}: use 'low', 'medium' "
                             "or 'high'")

    def strify(self, details: bool = False) -> str:
        """The reference's tag: ``DMDH6`` (``DMDH6l`` / ``DMDH6h`` for the other precisions)."""
        if details:
            return f"DMD_H({self.dmd_history}, {self.dmd_svd_precision})"
        prec = self.dmd_svd_precision[0]
        return f"DMDH{self.dmd_history}" + ("" if prec == "m" else prec)


def full_tag(config: DBCacheConfig, calibrator: Optional[CalibratorConfig] = None,
             accumulated_cached_steps: Optional[int] = None) -> str:
    """The reference's ``cache_dit.strify(pipe)`` cache part: ``<config>_<calibrator or T0O0>[_S<cached>]``."""
    tag = f"{config.strify()}_{calibrator.strify() if calibrator is not None else 'T0O0'}"
    if accumulated_cached_steps:
        tag += f"_S{accumulated_cached_steps}"
    return tag
