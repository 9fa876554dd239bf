"""cache-dit 1.5.3's user-facing API over ``compile_dit``: ``import dit_passes as cache_dit`` and keep your code.

    cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(), quantize_config=QuantizeConfig())
    cache_dit.enable_cache(pipe, cache_config=diffusers.hooks.FirstBlockCacheConfig(threshold=0.1))  # or MagCacheConfig
    out = pipe(...)
    cache_dit.summary(pipe); cache_dit.strify(pipe); cache_dit.disable_cache(pipe)

A pipeline: each of ``pipe.transformer`` / ``pipe.transformer_2`` (Wan 2.2) is replaced, on that instance, by a
:class:`~dit_passes.compiled.CompiledDiT` running [parallel, quantization, cache] passes; ``disable_cache(pipe)``
puts the original objects back (refused where those passes released weights, unless ``keep_original=True``). A bare
transformer: the CompiledDiT is *returned* (``pipe.transformer = enable_cache(pipe.transformer, ...)``); the module
is not changed in place. The cache starts a new generation when
the timestep rises again, and also after ``DBCacheConfig.num_inference_steps`` calls when set (the reference's
transformer-only mode). No class is patched; the applied configs live in ``compiled.runtime.state["frontend"]``.

``enable_separate_cfg=None`` (the default) is resolved from the calls, not from a per-pipeline table: a call whose
timestep and latents equal the previous call's is the next CFG branch of the same step, and each branch keeps its
own cache state and counts steps (``dit_passes.cache.branches``); a named ``cache_context`` ("cond" / "uncond") is a
branch of its own. ``True`` keeps the reference's call parity (refused at the second call where the first two calls
ran at different timesteps: a pipeline calling once per step); ``False`` one state for every call.

Differences from the reference: all parallel sizes 1 is a logged no-op; a second ``enable_cache`` raises (a wrapper from
``quantize`` / ``load`` is extended instead); ``use_ray=True`` runs the transformer(s) on Ray workers
(``pipe.transformer`` / ``pipe.transformer_2`` become proxies of one engine, ``pipe(...)`` works unchanged; a bare
transformer is also routed to the workers in place, as the reference's transformer wrapper does; ``refresh_context``
with a new config lowers again in the same workers; ``extra_parallel_modules`` are parallelised in the workers too,
the pipeline holding a proxy of each; ``components_to_quantize`` beyond the transformer are quantized where they
run; SVDQuant PTQ calibrates there while ``calibrate_fn`` drives the pipeline); a whole-pipeline engine is returned
only for ``ray_transfer_fn`` with ``pipe_or_module=None`` (the named extra modules, components and PTQ then done in
each worker's pipeline, ``calibrate_fn`` running there with ``model=`` its transformer).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..cache.config import CalibratorConfig, DBCacheConfig, DBPruneConfig, FoCaCalibratorConfig, \
    TaylorSeerCalibratorConfig
from ..cache.steps_mask import steps_mask
from ..compiled import DEFAULT_MAX_GRAPHS, CompiledDiT
from ..infra.pass_manager import PassManager
from ..passes.load_quantized import LoadQuantized
from ..quant.forms import DEFAULT_FORMS, QuantForms
from .cache_configs import CACHE_PASSES, cache_pass, cache_tag, resolve_calibrator, with_pipeline_timestep
from .cache_configs import resolve_cache_config as _resolve_cache_config
from . import components
from .calibration import calibrate
from .attention_names import attention_pass
from ..passes.attention_backend import AttentionBackend
from .configs import ParallelismConfig, QuantizeConfig
from .ray_workers import FactoryPlan, calibrate_on_workers, setup_factory_workers, without_calibrate_fns, \
    worker_extra

logger = logging.getLogger("dit_passes")
TRANSFORMER_ATTRS = components.TRANSFORMER_NAMES
FRONTEND = "frontend"  # key in the CompiledDiT's runtime.state


@dataclasses.dataclass
class FrontendState:
    """What ``enable_cache`` / ``quantize`` / ``load`` applied to one transformer (kept with its wrapper)."""

    cache_config: Optional[DBCacheConfig]
    calibrator_config: Optional[CalibratorConfig]
    parallelism_config: Optional[ParallelismConfig]
    quantize_config: Optional[QuantizeConfig]
    passes: list
    restore: Any = None  # what disable_cache puts back: the original transformer, or the wrapper extended
    extra_restore: List[Tuple[str, Any]] = dataclasses.field(default_factory=list)  # (pipe attribute, original)
    engine: Any = None  # the RayEngine when the transformer runs on Ray workers
    engine_index: int = 0  # which of the engine's transformers (1: Wan 2.2's transformer_2)
    routed: Dict[str, Any] = dataclasses.field(default_factory=dict)  # _route_to_proxy: instance entries it replaced
    attention_backend: Optional[str] = None  # enable_cache(attention_backend=...) without parallelism: the kernel pinned

    def cache_options(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.cache_config is not None:
            out["cache_config"] = self.cache_config
            if self.calibrator_config is not None:
                out["calibrator_config"] = self.calibrator_config
        return out


# ------------------------------------------------------------------------------------------ finding
def _is_pipeline(obj: Any) -> bool:
    from diffusers import DiffusionPipeline
    return isinstance(obj, DiffusionPipeline)


def _has_repeated_blocks(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(b) for b in m}) == 1
               for m in module.modules())


def _state_of(module: Any) -> Optional[FrontendState]:
    if isinstance(module, CompiledDiT):
        return module.runtime.state.get(FRONTEND)
    return getattr(module, "__dict__", {}).get("_dit_frontend")  # the Ray proxy: an instance attribute


def _name(attr: Optional[str], module: Any) -> str:
    return attr or type(getattr(module, "original", module)).__name__


def _targets(pipe_or_module: Any) -> List[Tuple[Any, Optional[str], Any]]:
    """``(owner, attribute, module)`` per transformer; owner and attribute are None for a bare module."""
    if _is_pipeline(pipe_or_module) or (not isinstance(pipe_or_module, torch.nn.Module)
                                        and hasattr(pipe_or_module, "transformer")):
        attrs = [a for a in TRANSFORMER_ATTRS if isinstance(getattr(pipe_or_module, a, None), torch.nn.Module)]
        if not attrs:
            raise TypeError(f"{type(pipe_or_module).__name__} has no transformer (pipe.transformer): enable_cache "
                            "accelerates Diffusion Transformer pipelines (UNet pipelines are not supported)")
        return [(pipe_or_module, a, getattr(pipe_or_module, a)) for a in attrs]
    if isinstance(pipe_or_module, torch.nn.Module):
        return [(None, None, pipe_or_module)]
    raise TypeError(f"expected a diffusers pipeline or a transformer nn.Module, got {type(pipe_or_module).__name__}")


def _check_target(owner: Any, attr: Optional[str], module: Any, allow_extend: bool) -> Optional[FrontendState]:
    """Refuse a second enable_cache. A wrapper from ``quantize`` / ``load`` (quantization only) may be extended:
    its passes are kept and ``disable_cache`` gives that wrapper back. Returns its state, or None."""
    state = _state_of(module)
    where = f"{type(owner).__name__}.{attr}" if owner is not None else type(module).__name__
    if allow_extend and state is not None and state.engine is None and state.cache_config is None \
            and state.parallelism_config is None:
        return state
    if isinstance(module, CompiledDiT) or state is not None:
        raise RuntimeError(f"enable_cache: {where} is already accelerated ({type(module).__name__}); call "
                           "disable_cache(...) first, or refresh_context(...) to change the cache config")
    if not _has_repeated_blocks(module):
        raise TypeError(f"{where} ({type(module).__name__}) is not a Diffusion Transformer: it has no list of "
                        "repeated blocks (nn.ModuleList) to cache, parallelise or quantize")
    return None


# ------------------------------------------------------------------------------------------ configs
def _check_parallel_env(pc: ParallelismConfig) -> None:
    import torch.distributed as dist
    pc.check_supported()
    n = pc.world_size()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{pc.strify()} needs {n} processes with torch.distributed initialised (torchrun + "
                           "init_process_group), or ParallelismConfig(use_ray=True) to start the workers")
    if dist.get_world_size() != n:
        raise ValueError(f"{pc.strify()} spans {n} ranks but the process group has {dist.get_world_size()}")


def _tp_size(pc: Optional[ParallelismConfig]) -> int:
    """The tensor-parallel size the quantization passes run after (their row-parallel linears' form)."""
    return pc.sizes()[2] if pc is not None else 1


def _wrap(original: torch.nn.Module, state: FrontendState, base: Optional[CompiledDiT] = None,
          keep_original: bool = False, max_graphs: Optional[int] = DEFAULT_MAX_GRAPHS) -> CompiledDiT:
    """The CompiledDiT for ``state`` (on top of wrapper ``base``'s passes when given). SVDQ PTQ calibrates now (the
    pipeline still holds ``original``) and lowers with the first calibration call's inputs, so ``serialize_to`` is
    written before this returns."""
    q = state.quantize_config
    calibrated = example = None
    if q is not None and q.is_ptq():
        calibrated, example = calibrate(q, original)
    passes = list(base.passes) if base is not None else []
    if state.parallelism_config is not None:
        passes += state.parallelism_config.to_passes()
    if q is not None:
        passes += q.to_passes(original, calibrated, tp_size=_tp_size(state.parallelism_config))
    pin = attention_pass(state.attention_backend)
    if pin is not None:
        passes = [p for p in passes if not isinstance(p, AttentionBackend)] + [pin]
    if state.cache_config is not None:
        passes.append(cache_pass(state.cache_config, state.calibrator_config))
    state.passes = passes
    # validates the pass list and its order
    compiled = CompiledDiT(original, passes, keep_original=keep_original, max_graphs=max_graphs)
    if base is not None:  # the weights base's passes released: their replacements are in its ledger
        compiled.runtime.weights = base.runtime.weights
    compiled.runtime.state[FRONTEND] = state
    if example is not None:
        compiled.lower(**example)
    return compiled


# ------------------------------------------------------------------------------------------ enable / disable
def enable_cache(pipe_or_module: Any = None, cache_config: Optional[DBCacheConfig] = None,
                 parallelism_config: Optional[ParallelismConfig] = None,
                 quantize_config: Optional[QuantizeConfig] = None,
                 calibrator_config: Optional[CalibratorConfig] = None, keep_original: bool = False,
                 attention_backend: Optional[str] = None, max_graphs: Optional[int] = DEFAULT_MAX_GRAPHS) -> Any:
    """Accelerate a pipeline (returned, its transformer(s) replaced) or a transformer (its wrapper is returned:
    use that). ``cache_config=None``: the default ``DBCacheConfig()`` when no parallelism / quantize config is
    given, else no residual cache (the reference's rule). Weights that tensor parallelism or quantization replace
    leave the transformer (``disable_cache`` then refuses); ``keep_original=True`` keeps it whole, at the cost of a
    full copy of those weights. ``attention_backend``: a pinned SDPA kernel (``"_native_cudnn"``, ...,
    :mod:`~dit_passes.frontend.attention_names`) for every attention, as cache-dit's argument (with parallelism it
    is the config's ``attention_backend``; the two must agree). ``enable_cache(pipe, **load_configs(path))`` takes a
    configuration file's every section. ``max_graphs``: the most lowered graphs (one per resolution / batch / text
    length) each transformer's wrapper keeps, least recently called evicted (``compile_dit``'s; also settable later
    as ``pipe.transformer.max_graphs``); not with ``use_ray=True`` (the workers keep the default). See the module
    docstring. A PyramidAttentionBroadcast / FasterCache config on a pipeline without ``current_timestep_callback``
    or ``timestep_scale`` gets the pipeline's ``current_timestep`` as its callback (its ranges are in the
    scheduler's units, as diffusers')."""
    pc = parallelism_config
    if pc is not None and not isinstance(pc, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a ParallelismConfig, got {type(pc).__name__}")
    if quantize_config is not None and not isinstance(quantize_config, QuantizeConfig):
        raise TypeError(f"quantize_config must be a QuantizeConfig, got {type(quantize_config).__name__}")
    attention_pass(attention_backend)  # a name no kernel here runs: refused before anything is built
    if attention_backend is not None and pc is not None and not pc.is_noop():
        if pc.attention_backend not in (None, attention_backend):
            raise ValueError(f"enable_cache(attention_backend={attention_backend!r}) and ParallelismConfig."
                             f"attention_backend={pc.attention_backend!r} disagree: give one")
        pc = dataclasses.replace(pc, attention_backend=attention_backend)
        attention_backend = None
    if pipe_or_module is None and (pc is None or not pc.use_ray or pc.ray_transfer_fn is None):
        raise ValueError("pipe_or_module can only be None with ParallelismConfig(use_ray=True, ray_transfer_fn=...)")
    if pc is not None and not pc.use_ray and pc.ray_transfer_fn is not None:
        logger.warning("ParallelismConfig.ray_transfer_fn is ignored without use_ray=True")
    cfg = _resolve_cache_config(cache_config, pc is not None or quantize_config is not None)
    cal = resolve_calibrator(calibrator_config)
    if cal is not None and cfg is None:
        raise ValueError("calibrator_config needs a residual cache: pass cache_config=DBCacheConfig(...) too")
    if pc is not None and pc.is_noop():
        logger.info("ParallelismConfig: every size is 1 / None: no parallelism applied (no-op)")
        if attention_pass(pc.attention_backend) is not None:
            warnings.warn(f"ParallelismConfig.attention_backend={pc.attention_backend!r} is applied with parallelism "
                          "only (as in cache-dit, which refuses a config of sizes 1); every size is 1 here, so it is "
                          "not applied: add passes.AttentionBackend(...) through compile_dit to pin the kernel",
                          stacklevel=2)
        pc = None
    if pc is not None and pc.use_ray and max_graphs != DEFAULT_MAX_GRAPHS:
        raise ValueError(f"enable_cache(max_graphs={max_graphs!r}) with ParallelismConfig(use_ray=True): the Ray "
                         f"workers build their modules with the default limit ({DEFAULT_MAX_GRAPHS} graphs); drop "
                         f"max_graphs, or run the ranks yourself (torchrun) to set it")
    if pc is not None and pc.use_ray:
        return _enable_with_ray(pipe_or_module, FrontendState(cfg, cal, pc, quantize_config, []), keep_original)
    if pc is not None:
        _check_parallel_env(pc)
    targets = _targets(pipe_or_module)
    cfg = with_pipeline_timestep(cfg, targets[0][0])  # PAB / FasterCache: ranges in the pipeline's timestep units
    extra_parallel = pc.extra_parallel_modules if pc is not None and pc.extra_parallel_modules else []
    if extra_parallel and targets[0][0] is None:
        raise ValueError("ParallelismConfig.extra_parallel_modules needs the pipeline: enable_cache(pipe, ...)")
    quantized, others = components.plan(pipe_or_module, quantize_config)  # which components, which config each
    bases = [_check_target(o, a, m, allow_extend=quantize_config is None) for o, a, m in targets]
    wrapped = []
    for (owner, attr, module), base in zip(targets, bases):
        state = FrontendState(cfg, cal, pc, quantized.get(attr or "transformer"), [], restore=module,
                              attention_backend=attention_backend)
        original = module.original if base is not None else module
        wrapped.append((owner, attr, _wrap(original, state, module if base is not None else None, keep_original,
                                           max_graphs)))
    for owner, attr, compiled in wrapped:  # assigned only once every transformer succeeded
        if owner is not None:
            setattr(owner, attr, compiled)
    owner, first = targets[0][0], _state_of(wrapped[0][2])
    extra_parallel = components.extra_modules(owner, extra_parallel)  # names resolved as the reference does
    # text encoders in components_to_quantize (one also in extra_parallel_modules: its TP passes, then these)
    first.extra_restore, quant_passes = components.quantize_components(owner, others, keep_original, extra_parallel)
    if extra_parallel:  # TE-P / VAE-P / CN-P
        from ..passes.parallel_plan import parallelize_extra_modules
        first.extra_restore += parallelize_extra_modules(owner, extra_parallel, pc.world_size(), pc.to_passes,
                                                         keep_original=keep_original, then=quant_passes)
        logger.info("enable_cache(%s): passes %s", _name(attr, compiled), [p.name for p in _state_of(compiled).passes])
    return pipe_or_module if targets[0][0] is not None else wrapped[0][2]


def set_attn_backend(pipe_or_module: Any, attention_backend: Optional[str] = None) -> None:
    """cache-dit's ``set_attn_backend``: pin the SDPA kernel of every attention of an accelerated transformer (a
    wrapper of ``enable_cache`` / ``quantize`` / ``compile_dit``, or a pipeline holding them); ``"native"`` removes a
    pin, ``None`` does nothing (as there). The graphs are lowered again at the next call. A transformer not yet
    accelerated is refused: ``enable_cache(pipe, attention_backend=...)`` pins it as it is accelerated."""
    if attention_backend is None:
        return
    pin = attention_pass(attention_backend)
    targets = _targets(pipe_or_module)
    for _, attr, module in targets:  # refuse before anything changes
        if not isinstance(module, CompiledDiT):
            raise ValueError(f"set_attn_backend: {_name(attr, module)} is not accelerated by dit_passes (a "
                             f"{type(module).__name__}): use enable_cache(pipe, attention_backend="
                             f"{attention_backend!r}) or compile_dit(..., passes=[passes.AttentionBackend(...)])")
    for _, _, module in targets:
        passes = [p for p in module.passes if not isinstance(p, AttentionBackend)] + ([pin] if pin else [])
        module.set_passes(passes)
        state = _state_of(module)
        if state is not None:
            state.passes, state.attention_backend = passes, attention_backend


def _ray_launcher(pc: ParallelismConfig):
    """The :class:`~dit_passes.launch.ray_launcher.RayLauncher` for ``use_ray=True`` (here, not in the
    config: configs are plain data, the front end is the layer that may import the launcher)."""
    from ..launch.ray_launcher import RayLauncher
    n = pc.ray_num_workers or pc.world_size()
    if pc.world_size() > 1 and n != pc.world_size():
        raise ValueError(f"ParallelismConfig.ray_num_workers={n} differs from the parallel sizes' product "
                         f"{pc.world_size()}")
    if pc.ray_use_flashpack:
        raise ValueError("ParallelismConfig.ray_use_flashpack=True: cache-dit's snapshot format switch; dit_passes "
                         "sends the modules through Ray's object store or a safetensors snapshot (ray_transfer_backend="
                         "'object_store' / 'snapshot'), not flashpack: leave it False")
    if pc.ray_transfer_custom_obj is not True:
        raise ValueError(f"ParallelismConfig.ray_transfer_custom_obj={pc.ray_transfer_custom_obj!r}: cache-dit's switch "
                         f"for the custom-class map of its from_pretrained snapshots; dit_passes' transfers rebuild "
                         f"each module by its own class (no map to turn off): leave it True")
    return RayLauncher(world_size=n, runtime_env=pc.ray_runtime_env, ray_init_kwargs=dict(pc.ray_init_kwargs or {}),
                       address=pc.ray_address, worker_options=dict(pc.ray_worker_options or {}),
                       master_port=pc.ray_master_port or 0,
                       auto_shutdown=pc.ray_auto_shutdown)


def _enable_with_ray(pipe_or_module: Any, state: FrontendState, keep_original: bool = False) -> Any:
    """``use_ray=True``: RayLauncher workers build and run the passes. A pipeline / transformer: the transformer(s)
    run there (``pipe.transformer`` and ``pipe.transformer_2`` become proxies of one engine, both lowered in every
    worker), and so do ``extra_parallel_modules`` (each replaced in the workers by its parallel version: TE-P, VAE-P,
    CN-P; a module proxy in the pipeline). ``components_to_quantize`` beyond the transformer(s): a component that runs
    in the workers (an extra module) is quantized there after its parallel passes, any other here, where the
    pipeline runs it. SVDQuant PTQ: ``calibrate_fn`` runs the pipeline here while the workers run the original
    transformer(s) and record the linears' activations; then they quantize (rank 0 writes ``serialize_to``).
    ``ray_transfer_fn``: the whole-pipeline engine is returned; the named extra modules, the components to quantize
    and PTQ (``calibrate_fn`` runs in each worker, ``model=`` its transformer) are done in each worker's pipeline."""
    pc, q = state.parallelism_config, state.quantize_config
    pc.check_supported()
    launcher = _ray_launcher(pc)
    if pc.ray_transfer_fn is not None:
        plan = FactoryPlan.of(pc, q)
        for tq in plan.transformers:  # validated here (a filter_fn needs the module: there)
            checked = tq if tq is None or tq.filter_fn is None else dataclasses.replace(tq, filter_fn=None)
            state.passes = _worker_passes(None, checked, state.cache_config, state.calibrator_config)
        if pipe_or_module is not None:
            logger.warning("ray_transfer_fn is set: the workers build their own pipeline; the one given is unused")
        state.quantize_config = without_calibrate_fns(plan.transformers)
        engine = launcher.launch(pc.ray_transfer_fn, _worker_passes_fn(state), transfer="factory",
                                 compile=bool(pc.ray_use_compile))
        if plan.needs_setup():
            try:
                done = setup_factory_workers(engine, _without_modules(pc), plan)
            except BaseException:
                engine.shutdown()
                raise
            logger.info("enable_cache(ray_transfer_fn): in each worker's pipeline %s", done[0])
        return engine
    targets = _targets(pipe_or_module)
    for owner, attr, module in targets:
        _check_target(owner, attr, module, allow_extend=False)
    owner = targets[0][0]
    quantized, others = components.plan(pipe_or_module, q)
    qs = tuple(quantized.get(n) for n in TRANSFORMER_ATTRS)  # the engine's i-th transformer: TRANSFORMER_ATTRS[i]
    ptq = any(c is not None and c.is_ptq() for c in qs)
    modules = [module for _, _, module in targets]
    extras = []
    if pc.extra_parallel_modules:  # TE-P / VAE-P / CN-P, in the workers
        if owner is None:
            raise ValueError("ParallelismConfig.extra_parallel_modules needs the pipeline: enable_cache(pipe, ...)")
        from ..passes.parallel_plan import extra_components
        extras = extra_components(owner, components.extra_modules(owner, pc.extra_parallel_modules))
    extra_index = {attr: j for j, (attr, _) in enumerate(extras)}
    # quantized after their TE-P, there (float8 / int8: without the calibrate_fn they inherit, which holds the pipeline)
    in_workers = {extra_index[a]: without_calibrate_fns([c])[0] for a, c in others if a in extra_index}
    here = [(a, c) for a, c in others if a not in extra_index]  # quantized in this process, where they run
    for j, c in in_workers.items():
        c.to_passes(extras[j][1])  # validated here
    for i, (_, _, module) in enumerate(targets):
        state.passes = _worker_passes(None, qs, state.cache_config, state.calibrator_config, module=module,
                                      calibrated={} if ptq else None, index=i)  # validated here
    state.quantize_config = qs
    engine = launcher.launch(modules if len(modules) > 1 else modules[0], _worker_passes_fn(state), level="transformer",
                             transfer=pc.ray_transfer(), compile=bool(pc.ray_use_compile),
                             extra_modules=[m for _, m in extras],
                             extra_fn=functools.partial(worker_extra, _without_modules(pc), in_workers)
                             if extras else None)
    result = None
    for index, (owner_i, attr, module) in enumerate(targets):
        proxy = engine.as_transformer(index)
        proxy.__dict__["_dit_frontend"] = own = dataclasses.replace(state, passes=list(state.passes), restore=module,
                                                                    quantize_config=qs[index], engine=engine,
                                                                    engine_index=index, routed={},
                                                                    extra_restore=list(extras) if index == 0 else [])
        if owner_i is None:
            _route_to_proxy(module, proxy, own)
            result = proxy
        else:
            setattr(owner_i, attr, proxy)
    for j, (attr, module) in enumerate(extras):
        setattr(owner, attr, engine.as_module(j, module))
    try:
        if ptq:
            calibrate_on_workers(engine, qs)
        if here:  # after calibration, as the reference quantizes the transformer before the other components
            restore, _ = components.quantize_components(owner, here, keep_original)
            _state_of(getattr(owner, targets[0][1])).extra_restore += restore
    except BaseException:
        disable_cache(pipe_or_module)
        raise
    return result if result is not None else owner


def _worker_passes_fn(state: FrontendState) -> Callable[..., list]:
    """What each worker calls to build a transformer's passes. The configs (one per transformer, a tuple) travel
    without the objects of this process they hold (``calibrate_fn`` holds the pipeline, calibration is driven from
    here; the extra modules travel once, as modules)."""
    q = state.quantize_config
    q = without_calibrate_fns(q) if isinstance(q, tuple) else without_calibrate_fns([q])[0]
    return functools.partial(_worker_passes, _without_modules(state.parallelism_config), q, state.cache_config,
                             state.calibrator_config)


def _without_modules(pc: ParallelismConfig) -> ParallelismConfig:
    out = copy.copy(pc)
    out.extra_parallel_modules = []
    return out


_ROUTED = ("forward", "cache_context", "to", "cuda", "cpu", "_dit_frontend")
_ABSENT = object()


def _route_to_proxy(module: torch.nn.Module, proxy: Any, state: FrontendState) -> None:
    """The reference's transformer wrapper changes the transformer it is given (its seed example does not assign
    the result). On this instance only: calls go to the workers and ``.to()`` / ``.cuda()`` / ``.cpu()`` move
    nothing, so ``pipe.to("cuda")`` leaves the main-process copy where it is. ``disable_cache`` undoes it."""
    def keep(*_: Any, **__: Any) -> torch.nn.Module:
        return module
    # what the instance held before (another hook's forward, say), put back exactly by disable_cache
    state.routed = {name: module.__dict__.get(name, _ABSENT) for name in _ROUTED}
    module.__dict__.update(forward=proxy.forward, cache_context=proxy.cache_context, to=keep, cuda=keep, cpu=keep,
                           _dit_frontend=state)


def _worker_passes(pc: Optional[ParallelismConfig], q: Any, cfg: Optional[DBCacheConfig],
                   cal: Optional[CalibratorConfig], rank: int = 0, world_size: int = 1, module: Any = None,
                   calibrated: Optional[Dict[str, Any]] = None, index: int = 0) -> list:
    """The pass list, built in each Ray worker (its process group exists there; CP x TP builds subgroups) for
    ``module``, the ``index``-th transformer it lowers (``filter_fn``'s modules, ``_repeated_blocks``); ``q``: a
    QuantizeConfig, or a tuple of one per transformer (None: not quantized). SVDQuant PTQ without ``calibrated``
    statistics: no quantize pass yet (added after calibration, :mod:`~dit_passes.frontend.ray_workers`)."""
    if isinstance(q, tuple):
        q = q[index] if index < len(q) else None
    quant = [] if q is None or (q.is_ptq() and calibrated is None) else q.to_passes(module, calibrated,
                                                                                     tp_size=_tp_size(pc))
    passes = (pc.to_passes() if pc is not None else []) + quant + ([cache_pass(cfg, cal)] if cfg is not None else [])
    PassManager(passes)
    return passes


def _with_cache_pass(cfg: DBCacheConfig, cal: Optional[CalibratorConfig], passes: list) -> list:
    """``passes`` with its cache pass replaced by one for ``cfg`` (refresh_context; in Ray workers too)."""
    return [p for p in passes if not isinstance(p, CACHE_PASSES)] + [cache_pass(cfg, cal)]


def disable_cache(pipe_or_module: Any) -> Any:
    """Undo ``enable_cache``: a pipeline gets its original transformer object(s) back and is returned; for a
    wrapper, the module it wrapped is returned. Ray workers started for it are shut down."""
    restored = []
    targets = _targets(pipe_or_module)
    for owner, attr, module in targets:  # refuse before anything is undone
        state = _state_of(module)
        if state is None:
            continue
        restores = [] if isinstance(state.restore, CompiledDiT) else [(attr, module)]
        restores += [(a, getattr(owner, a, None)) for a, _ in state.extra_restore]  # text encoders' TP
        for name, wrapper in restores:
            released = wrapper.released if isinstance(wrapper, CompiledDiT) else {}
            if released:
                path, how = next(iter(released.items()))
                raise RuntimeError(
                    f"disable_cache: {len(released)} weight(s) of {_name(name, wrapper)} were released when its "
                    f"passes replaced them (e.g. {path}: {how}); the original module holds meta tensors there and "
                    f"cannot run. Reload it (e.g. {type(wrapper.original).__name__}.from_pretrained(...)) and assign "
                    f"it back, or call enable_cache(..., keep_original=True) to keep a full copy (memory: every "
                    f"replaced weight twice)")
    for owner, attr, module in targets:
        state = _state_of(module)
        if state is None:
            continue
        if state.engine is not None:
            state.engine.shutdown()
            for name, before in state.routed.items():  # a bare transformer routed to the workers (_route_to_proxy)
                if before is _ABSENT:
                    state.restore.__dict__.pop(name, None)
                else:
                    state.restore.__dict__[name] = before
        if owner is not None:
            setattr(owner, attr, state.restore)
            for extra_attr, original in state.extra_restore:
                setattr(owner, extra_attr, original)
        restored.append(state.restore)
    if not restored:
        logger.warning("disable_cache: %s was not accelerated; nothing to undo", type(pipe_or_module).__name__)
        return pipe_or_module
    return restored[0] if _targets(pipe_or_module)[0][0] is None else pipe_or_module


# ------------------------------------------------------------------------------------------ refresh
def refresh_context(pipe_or_module: Any, cache_config: Optional[DBCacheConfig] = None,
                    calibrator_config: Optional[CalibratorConfig] = None, verbose: bool = False,
                    **cache_fields: Any) -> Any:
    """Start a new generation. With ``cache_config`` (a new config) or cache fields merged into the current one
    (e.g. ``num_inference_steps=50``) the cache is rebuilt; its graphs are lowered again at the next call."""
    if cache_config is not None and cache_fields:
        raise TypeError("pass either cache_config=DBCacheConfig(...) or cache fields, not both")
    for owner, attr, module in _targets(pipe_or_module):
        state = _state_of(module)
        if state is None or state.cache_config is None:
            raise RuntimeError(f"refresh_context: {_name(attr, module)} has no residual cache from enable_cache")
        names = {f.name for f in dataclasses.fields(type(state.cache_config))}
        if set(cache_fields) - names:
            raise TypeError(f"refresh_context: {sorted(set(cache_fields) - names)} are not "
                            f"{type(state.cache_config).__name__} fields ({sorted(names)})")
        new = state.cache_config
        if cache_config is not None:
            new = with_pipeline_timestep(_resolve_cache_config(cache_config, False), owner)
        elif cache_fields:
            new = dataclasses.replace(state.cache_config, **cache_fields)
        cal = state.calibrator_config if calibrator_config is None else \
            resolve_calibrator(calibrator_config)
        if new == state.cache_config and cal == state.calibrator_config:
            (state.engine.as_transformer(state.engine_index) if state.engine is not None else module).new_generation()
        else:
            state.cache_config, state.calibrator_config = new, cal
            state.passes = _with_cache_pass(new, cal, state.passes)
            if state.engine is not None:  # the same workers lower it again: no restart
                state.engine.set_passes(functools.partial(_with_cache_pass, new, cal), state.engine_index)
            else:
                module.set_passes(state.passes)
        if verbose:
            logger.info("refresh_context(%s): %s", _name(attr, module), cache_tag(new, cal))
    return pipe_or_module


# ------------------------------------------------------------------------------------------ quantization
def quantize(module: torch.nn.Module, quantize_config: Optional[QuantizeConfig] = None, keep_original: bool = False,
             quant_config: Optional[QuantizeConfig] = None, **fields: Any) -> CompiledDiT:
    """The reference's ``cache_dit.quantize(module, quantize_config=None, **kwargs)``: returns the quantized module, a
    CompiledDiT (assign it: ``pipe.transformer = quantize(pipe.transformer, QuantizeConfig(...))``). The config is
    ``quantize_config`` (also accepted as ``quant_config=``), or, as the reference's legacy form, built from
    QuantizeConfig fields given as keywords (``quantize(module, quant_type="float8_per_row")``, with a warning, as
    the reference); fields beside a config are ignored with a warning (the reference's rule), unknown keywords
    raise ``TypeError``; neither: the default ``QuantizeConfig()``. For SVDQ PTQ ``calibrate_fn`` runs now, with the
    pipeline still holding ``module``, and ``serialize_to`` is written before this returns. The quantized linears'
    weights leave ``module`` (meta tensors) unless ``keep_original=True`` (a full copy of them kept)."""
    if quant_config is not None:
        if quantize_config is not None and quantize_config is not quant_config:
            raise TypeError("quantize: pass the config once, as quantize_config=... (quant_config= is its other name)")
        quantize_config = quant_config
    names = {f.name for f in dataclasses.fields(QuantizeConfig)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"quantize: unknown keyword(s) {unknown}; pass quantize_config=QuantizeConfig(...) or "
                        f"QuantizeConfig fields ({sorted(names)})")
    if quantize_config is None:
        if fields:
            warnings.warn(f"quantize: QuantizeConfig fields as keywords ({sorted(fields)}) are the reference's "
                          "deprecated form; pass quantize_config=QuantizeConfig(...)", DeprecationWarning, stacklevel=2)
        quantize_config = QuantizeConfig(**fields)
    elif fields:
        warnings.warn(f"quantize: {sorted(fields)} are ignored since quantize_config is given (the reference's rule); "
                      "set them in the QuantizeConfig", stacklevel=2)
    if not isinstance(quantize_config, QuantizeConfig):
        raise TypeError(f"quantize_config must be a QuantizeConfig, got {type(quantize_config).__name__}")
    if not isinstance(module, torch.nn.Module) or isinstance(module, CompiledDiT):
        raise TypeError(f"quantize needs the original transformer nn.Module, got {type(module).__name__}")
    _check_target(None, None, module, allow_extend=False)
    return _wrap(module, FrontendState(None, None, None, quantize_config, [], restore=module),
                 keep_original=keep_original)


def load(module: torch.nn.Module, path: Any, quant_type: Optional[str] = None, *,
         forms: Optional[QuantForms] = None, **kwargs: Any) -> CompiledDiT:
    """The reference's ``cache_dit.load(transformer, quantize_config_or_path)``: a CompiledDiT with the saved
    quantized linears. ``path``: the ``serialize_to`` directory or its ``<quant_type>.safetensors`` file, or the
    ``QuantizeConfig`` that wrote it (its ``serialize_to`` and ``quant_type``). A wrapper from
    ``quantize`` / ``enable_cache`` is unwrapped to its original module first (weights its passes released are
    fine where the checkpoint replaces them: their fingerprint sample was kept); ``forms``: how the loaded linears are
    written (``dit_passes.quant.forms.QuantForms``, the quantize passes' form settings; default: per device);
    ``passes=[...]`` run after the
    substitution, other keyword arguments go to ``compile_dit`` (``keep_original=True`` too). Raises
    :class:`~dit_passes.quant.serialize.QuantizedCheckpointError` for a missing, corrupted or mismatching
    checkpoint."""
    from .. import compile_dit
    if isinstance(path, QuantizeConfig):  # the reference's load(module, quantize_config): its serialize_to
        if path.serialize_to is None:
            raise ValueError("load(module, QuantizeConfig(...)): the config has no serialize_to; set it to the "
                             "directory (or <dir>/<quant_type>.safetensors) the checkpoint was written to")
        if quant_type is not None and quant_type.lower() != path.quant_type:
            raise ValueError(f"load: quant_type={quant_type!r} differs from the config's {path.quant_type!r}")
        path, quant_type = path.serialize_dir(), path.quant_type
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"load: expected a QuantizeConfig or a checkpoint path, got {type(path).__name__}")
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        quant_type = quant_type or os.path.basename(path)[:-len(".safetensors")]
        path = os.path.dirname(path) or "."
    original = module.original if isinstance(module, CompiledDiT) else module
    extra = list(kwargs.pop("passes", ()))
    loader = LoadQuantized.from_checkpoint(original, path, quant_type, forms or DEFAULT_FORMS)
    compiled = compile_dit(original, passes=[loader, *extra], **kwargs)
    compiled.runtime.state[FRONTEND] = FrontendState(None, None, None, None, [loader, *extra], restore=original)
    return compiled


__all__ = ["enable_cache", "disable_cache", "refresh_context", "steps_mask", "quantize", "load", "FrontendState",
           "DBCacheConfig", "DBPruneConfig", "TaylorSeerCalibratorConfig", "FoCaCalibratorConfig", "ParallelismConfig",
           "QuantizeConfig"]
