"""AttentionBackend: pin the kernel every attention runs on (e.g. cuDNN on Hopper).

``F.scaled_dot_product_attention`` picks its kernel at run time from a fixed priority list; on an H200 with
torch 2.11 that is FlashAttention-2 for bf16, while cuDNN's fused attention is faster at DiT shapes (24 heads,
4608 tokens, head dim 128: bench/results/flux_cache_peers_h200.md, attention_backends_h200.json). The choice cannot be made from outside a
compiled graph (the ``sdpa_kernel`` context manager is not a graph node), so this pass puts it in the graph:
each ``aten.scaled_dot_product_attention`` becomes ``dit_passes::sdpa_backend`` with the backends to try, in
order. The op is opaque to Inductor, which would fall back to the aten kernel for attention anyway.

Requires: a graph with ``aten.scaled_dot_product_attention`` nodes (dropout 0; no ``enable_gqa``). Runs after
the parallel passes (their attention rewrites look for the aten op) and before ``dbcache`` /
``regional_compile`` (so both arms of the cache branch and every block template carry it). Guarantees: the
same attention (only the kernel changes: equal to rounding, ~1e-3 relative in bf16); the output keeps the
layout the aten op would give (the layout of ``q``), so the graph around it is unchanged. With
``fallback=True`` (default) the remaining backends stay behind the preferred ones, so an input the preferred
kernel does not support (a CPU tensor, an unsupported mask) still runs; with ``fallback=False`` such an
input raises an error naming the backend.

Before::

    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(permute, permute_1, permute_2)

After::

    sdpa_backend = torch.ops.dit_passes.sdpa_backend.default(permute, permute_1, permute_2, None, False, None,
                                                             'cudnn,flash,efficient,math')

``counts``: ``attention_rewritten``, ``attention_skipped`` (dropout or grouped-query attention).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..infra.pass_base import Pass, PassContext, PassResult
from ..infra.phases import Phase

aten = torch.ops.aten
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def _layout_of(q: torch.Tensor) -> List[int]:
    """``q``'s dims from outermost to innermost in memory (stable for equal strides)."""
    return sorted(range(q.dim()), key=lambda d: (-q.stride(d), d))


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> List[int]:
    return [*q.shape[:-1], v.shape[-1]]


def _has_layout(t: torch.Tensor, order: List[int]) -> bool:
    """Is ``t`` dense in the dim order ``order`` (outermost first)? Size-1 dims may have any stride."""
    expected = 1
    for d in reversed(order):
        if t.shape[d] > 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


@torch.library.custom_op("dit_passes::sdpa_backend", mutates_args=())
def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 is_causal: bool, scale: Optional[float], backends: str) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to ``backends`` (comma-separated, tried in that order), laid out
    like ``q``."""
    try:
        with sdpa_kernel([BACKENDS[b] for b in backends.split(",")], set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    except RuntimeError as e:
        raise RuntimeError(f"AttentionBackend: none of the backends [{backends}] runs this attention (q "
                           f"{tuple(q.shape)} {q.dtype} on {q.device}, mask {attn_mask is not None}); use "
                           f"AttentionBackend(..., fallback=True) to keep the other kernels behind it. {e}") from e
    order = _layout_of(q)
    if _has_layout(out, order):
        return out
    # a kernel with another output layout: the graph was traced with q's
    return torch.empty_permuted(_out_shape(q, v), order, dtype=out.dtype, device=out.device).copy_(out)


@sdpa_backend.register_fake
def _(q, k, v, attn_mask, is_causal, scale, backends):
    return torch.empty_permuted(_out_shape(q, v), _layout_of(q), dtype=q.dtype, device=q.device)


class AttentionBackend(Pass):
    name = "attention_backend"
    phase = Phase.ATTENTION_KERNEL

    def __init__(self, backend: Union[str, Sequence[str]] = "cudnn", fallback: bool = True):
        prefer = [backend] if isinstance(backend, str) else list(backend)
        unknown = [b for b in prefer if b not in BACKENDS]
        if not prefer or unknown:
            raise ValueError(f"AttentionBackend(backend={backend!r}): unknown {unknown or 'empty list'}; "
                             f"choose from {list(BACKENDS)}")
        self.backends = prefer + ([b for b in BACKENDS if b not in prefer] if fallback else [])
        self.fallback = fallback

    def config_items(self):
        return {"backends": self.backends}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        rewritten = skipped = 0
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
                continue
            args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), n.args))
            args.update(n.kwargs)
            if args.get("dropout_p", 0.0) != 0.0 or args.get("enable_gqa", False):
                skipped += 1
                continue
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(torch.ops.dit_passes.sdpa_backend.default, (
                    args["query"], args["key"], args["value"], args.get("attn_mask"), bool(args.get("is_causal", False)),
                    args.get("scale"), ",".join(self.backends)))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            rewritten += 1
        ctx.recompile_at_end(gm)
        report = (f"{rewritten} attentions run on {self.backends[0]} (then {self.backends[1:] or 'nothing'})"
                  + (f"; {skipped} left as they are (dropout or grouped-query attention)" if skipped else ""))
        if rewritten == 0 and skipped == 0:  # e.g. after Ulysses / Ring, whose attention picks its own kernel
            report = "no aten.scaled_dot_product_attention in the graph: nothing to pin"
        return PassResult(bool(rewritten), {"attention_rewritten": rewritten, "attention_skipped": skipped}, report)
