"""cache-dit-compatible front end: ``enable_cache`` / ``disable_cache`` / ``summary`` / ``strify`` / ... over
``compile_dit`` (see :mod:`dit_passes.frontend.api`, reports in :mod:`dit_passes.frontend.reports`)."""
from ..cache.config import (DBCacheConfig, DBPruneConfig, DMDCalibratorConfig, FoCaCalibratorConfig,
                            TaylorSeerCalibratorConfig)
from ..cache.peer_configs import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig,
                                  PyramidAttentionBroadcastConfig, SeaCacheConfig, TaylorSeerCacheConfig,
                                  TeaCacheConfig, TextKVCacheConfig)
from .api import (FrontendState, disable_cache, enable_cache, load, quantize, refresh_context, set_attn_backend,
                  steps_mask)
from .reports import CacheStats, strify, summary
from .configs import SUPPORTED_QUANT_TYPES, ParallelismConfig, QuantizeConfig
from .config_files import (load_attn_backend_config, load_cache_config, load_configs, load_options,
                           load_parallelism_config, load_quantize_config)
from .offload import (LayerwiseOffloadHandle, LayerwiseOffloadHandleGroup, get_layerwise_offload_handles,
                      layerwise_cpu_offload, layerwise_offload, remove_layerwise_offload)
from .cache_types import BasicCacheConfig, CacheType, DBCache, DBPrune, NONE, block_range, cache_type
from .process_utils import disable_print, init_logger, maybe_empty_cache, version_tuple
from .not_offered import NOT_OFFERED
from .profiler import (ProfilerContext, create_profiler_context, get_profiler_output_dir, profile_function,
                       set_profiler_output_dir)
from .compile_configs import set_compile_configs
from .supported import supported_matrix, supported_pipelines
from .components import parse_extra_modules
from .backends import ParallelismBackend, QuantizeBackend
from ..cache.config import CalibratorConfig

__all__ = ["enable_cache", "disable_cache", "refresh_context", "summary", "strify", "steps_mask", "quantize", "load",
           "CacheStats", "FrontendState", "DBCacheConfig", "DBPruneConfig", "TaylorSeerCalibratorConfig",
           "FoCaCalibratorConfig", "DMDCalibratorConfig", "FirstBlockCacheConfig",
           "MagCacheConfig", "TaylorSeerCacheConfig", "SeaCacheConfig", "TeaCacheConfig",
           "PyramidAttentionBroadcastConfig", "FasterCacheConfig", "TextKVCacheConfig", "ParallelismConfig",
           "QuantizeConfig", "SUPPORTED_QUANT_TYPES", "layerwise_offload", "load_configs", "load_cache_config",
           "load_parallelism_config", "load_quantize_config", "load_attn_backend_config", "load_options",
           "layerwise_cpu_offload", "BasicCacheConfig", "CacheType", "DBCache", "DBPrune", "NONE", "block_range",
           "cache_type", "disable_print", "init_logger", "maybe_empty_cache", "version_tuple", "NOT_OFFERED",
           "CalibratorConfig", "set_attn_backend", "ParallelismBackend",
           "QuantizeBackend", "ProfilerContext", "create_profiler_context", "get_profiler_output_dir",
           "profile_function", "set_profiler_output_dir", "set_compile_configs", "supported_matrix",
           "supported_pipelines", "parse_extra_modules", "LayerwiseOffloadHandle", "LayerwiseOffloadHandleGroup",
           "get_layerwise_offload_handles", "remove_layerwise_offload"]
