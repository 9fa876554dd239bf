"""The graph passes users put in ``compile_dit(model, passes=[...])``."""
from .cleanup import Cleanup
from .dbcache import DBCache
from .dbprune import DBPrune
from .first_block_cache import FirstBlockCache
from .mag_cache import MagCache
from .taylorseer_cache import TaylorSeerCache
from .sea_cache import SeaCache
from .tea_cache import TeaCache
from .pyramid_attention_broadcast import PyramidAttentionBroadcast
from .faster_cache import FasterCache
from .quantize import Fp8Linear, Int4WeightOnly, Int8Linear, NVFP4WeightOnly, SVDQuantW4A4
from .quantize_few_shot import SVDQuantFewShot
from .load_quantized import LoadQuantized
from .fuse_sibling_linears import FuseSiblingLinears
from .linear_gelu import FuseLinearGelu
from .split_concat_linear import SplitConcatLinear
from .norm_rope import FuseNormRope
from .norm_modulate import FuseNormModulate
from .context_parallel import USP, Ring, Ulysses
from .tensor_parallel import TensorParallel
from .offload import LayerwiseOffload
from .regional_compile import RegionalCompile
from .attention_backend import AttentionBackend
from .vae_parallel import VAEParallel

__all__ = ["Cleanup", "DBCache", "DBPrune", "FirstBlockCache", "MagCache", "TaylorSeerCache", "SeaCache", "TeaCache",
           "PyramidAttentionBroadcast", "FasterCache", "SVDQuantW4A4", "SVDQuantFewShot", "Fp8Linear", "Int8Linear",
           "Int4WeightOnly", "NVFP4WeightOnly", "LoadQuantized", "FuseSiblingLinears",
           "FuseLinearGelu", "SplitConcatLinear", "FuseNormRope", "FuseNormModulate",
           "Ulysses", "Ring", "USP", "TensorParallel", "LayerwiseOffload", "RegionalCompile", "AttentionBackend",
           "VAEParallel"]
