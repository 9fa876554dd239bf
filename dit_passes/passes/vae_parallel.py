"""VAEParallel: exact spatial parallelism of a diffusers VAE's decode / encode (VAE-P), as a graph pass.

    vae = dit_passes.parallel_vae(pipe.vae, size=2)   # after init_process_group; pipe.vae = vae

Contract: phase ``SHARD_SEQUENCE``; input the graph captured on this rank's slab of ``rows`` (and
``reference``, the same call on the full input, whose shapes check every node); output: the graph
takes the full input and returns the full output on every rank (rules: :mod:`dit_passes.parallel.vae`).
Counts ``halo_exchange``, ``all_reduce``, ``all_gather``, ``attention_gathered``; an op that would mix
rows raises ``VAEShardingError`` (a PassError and a NotImplementedError). Before / after (rank 0 of 2)::

    conv2d: "f32[1, 8, 2, 4]" = aten.conv2d(z, w, b, [1, 1], [1, 1])
    group_norm: "f32[1, 8, 2, 4]" = aten.group_norm(conv2d, 4, ...)

    slice_1: "f32[1, 4, 2, 4]" = aten.slice(z, 2, 0, 2)                   # z is the full latent now
    vae_halo_exchange = dit_passes.vae_halo_exchange(slice_1, 2, 1, 1, 1, 1, '0')
    conv2d: "f32[1, 8, 2, 4]" = aten.conv2d(vae_halo_exchange, w, b, [1, 1], [0, 1])
    vae_group_stats -> all_reduce -> wait_tensor -> vae_group_norm_apply   # global statistics
    ... all_gather_into_tensor -> wait_tensor -> cat                       # the full output

:class:`ParallelVAE` / :func:`parallel_vae`: the drop-in module (both captures per input signature,
this pass run by a PassManager, ``explain()``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..capture import capture
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.pass_manager import PassManager
from ..infra.phases import Phase
from ..infra.trace_templates import default_templates
from ..parallel import vae_ops
from ..parallel.mesh import check_ranks
from ..parallel.propagate import val as _val
from ..parallel.vae import shard_vae_graph

__all__ = ["ParallelVAE", "VAEParallel", "parallel_vae"]


class VAEParallel(Pass):
    """Split a captured VAE graph's rows over ``size`` ranks of ``group`` (default: the world group)."""

    name = "vae_parallel"
    phase = Phase.SHARD_SEQUENCE  # a spatial split of the tokens' rows: the sequence phase of a VAE graph

    def __init__(self, size: int, group: Optional[dist.ProcessGroup] = None, *, rows: Optional[Sequence[int]] = None,
                 reference: Optional[fx.GraphModule] = None):
        check_ranks("VAEParallel(size)", size)
        self.size, self.group, self.reference = size, group, reference
        self.rows = None if rows is None else [int(r) for r in rows]

    def config_items(self) -> Dict[str, Any]:
        return {"size": self.size, "rows": self.rows}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if self.size == 1:
            return PassResult(False, {}, "vae_parallel size=1: no-op, graph unchanged")
        if not (dist.is_available() and dist.is_initialized()):
            raise PassError(f"vae_parallel(size={self.size}) needs a torch.distributed process group: call "
                            f"torch.distributed.init_process_group(...) on every rank first")
        group = self.group if self.group is not None else dist.group.WORLD
        if group.size() != self.size or self.rows is None or len(self.rows) != self.size:
            raise PassError(f"vae_parallel: size={self.size}, the group has {group.size()} ranks, rows={self.rows}: "
                            f"give one row count per rank of the group (dit_passes.parallel_vae computes them)")
        counts = shard_vae_graph(gm, self.rows, group.rank(), group.group_name, reference=self.reference)
        report = (f"rank {group.rank()}/{self.size}: rows {self.rows}; " +
                  ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        return PassResult(True, counts, report)


class _Call(torch.nn.Module):
    """What is captured: ``vae.decode(z).sample`` or ``vae.encode(x).latent_dist.parameters``."""

    def __init__(self, vae, kind: str):
        super().__init__()
        self.vae, self.kind = vae, kind

    def forward(self, x):
        if self.kind == "decode":
            return self.vae.decode(x).sample
        return self.vae.encode(x).latent_dist.parameters


class VAEGraphs(torch.nn.Module):
    """Drop-in for a diffusers VAE whose ``decode`` / ``encode`` run as captured graphs rewritten by the passes
    ``then()`` returns (a fresh list per graph: e.g. a quantization's ``Int8Linear`` on the VAE's linears).

    Holds the original (``.vae``; ``.config``, ``.dtype``, ``.device`` and any other attribute are
    forwarded to it) and one rewritten graph per (kind, input shape, dtype, device)."""

    def __init__(self, vae: torch.nn.Module, then: Optional[Callable[[], Sequence[Pass]]] = None):
        super().__init__()
        self.vae = vae
        object.__setattr__(self, "_then", then)
        object.__setattr__(self, "_graphs", {})
        object.__setattr__(self, "_managers", {})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["vae"], name)

    def _further(self) -> List[Pass]:
        return list(self._then()) if self._then is not None else []

    def graph(self, kind: str, x: torch.Tensor) -> fx.GraphModule:
        """The rewritten graph for an input like ``x`` (captured on first use)."""
        key = (kind, tuple(x.shape), x.dtype, x.device)
        gm = self._graphs.get(key)
        if gm is None:
            gm = capture(_Call(self.vae, kind), (x,)).gm
            gm.graph.eliminate_dead_code()
            manager = PassManager(self._further())
            manager.run(gm)
            self._managers[key] = manager
            self._graphs[key] = gm
        return gm

    @torch.no_grad()
    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None):
        sample = self.graph("decode", z)(z)[0]
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput
        return DecoderOutput(sample=sample)

    @torch.no_grad()
    def encode(self, x: torch.Tensor, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput
        posterior = DiagonalGaussianDistribution(self.graph("encode", x)(x)[0])
        if not return_dict:
            return (posterior,)
        return AutoencoderKLOutput(latent_dist=posterior)

    def forward(self, sample: torch.Tensor, sample_posterior: bool = False, return_dict: bool = True,
                generator: Optional[torch.Generator] = None):
        posterior = self.encode(sample).latent_dist
        z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        return self.decode(z, return_dict=return_dict)

    def explain(self) -> str:
        """The pass manager's explain() of every graph built so far (what VAEParallel rewrote)."""
        return "\n".join(f"-- {k}{list(s)}\n{m.explain()}" for (k, s, *_), m in self._managers.items())

class ParallelVAE(VAEGraphs):
    """Drop-in for a diffusers VAE whose ``decode`` / ``encode`` run split over the ranks of ``group`` (then
    rewritten by the passes ``then()`` returns, e.g. a quantization of its linears).

    Holds the original (``.vae``; ``.config``, ``.dtype``, ``.device`` and any other attribute are
    forwarded to it) and one rewritten graph per (kind, input shape, dtype, device)."""

    def __init__(self, vae: torch.nn.Module, group: dist.ProcessGroup,
                 then: Optional[Callable[[], Sequence[Pass]]] = None):
        super().__init__(vae, then)
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_reports", {})

    def graph(self, kind: str, x: torch.Tensor) -> fx.GraphModule:
        """The rewritten graph for an input like ``x`` (captured on first use)."""
        key = (kind, tuple(x.shape), x.dtype, x.device)
        gm = self._graphs.get(key)
        if gm is None:
            if getattr(self.vae, "use_tiling", False):
                raise ValueError("VAE-P replaces tiling: call vae.disable_tiling() before parallel_vae")
            # through the process's trace templates (DIT_PASSES_REUSE_TRACES / DIT_PASSES_TRACE_DIR, as compile_dit
            # does): every rank captures the same full graph, and ranks with equal row counts the same local one
            templates = default_templates()
            full = capture(_Call(self.vae, kind), (x,), templates=templates).gm  # the single-process graph
            full.graph.eliminate_dead_code()
            hd, rank = x.dim() - 2, self._group.rank()
            height, out_h = x.shape[hd], _val(full.graph.output_node().args[0][0]).shape[-2]
            unit = height // out_h if out_h < height else 1  # encode: slabs of whole downsampled rows
            if height % unit:
                raise ValueError(f"VAE-P {kind}: height {height} is not a multiple of the downsampling {unit}")
            rows = vae_ops.split_rows(height, self._group.size(), unit)
            local = x.narrow(hd, sum(rows[:rank]), rows[rank]).contiguous()
            gm = capture(_Call(self.vae, kind), (local,), templates=templates).gm
            gm.graph.eliminate_dead_code()
            manager = PassManager([VAEParallel(self._group.size(), self._group, rows=rows, reference=full),
                                   *self._further()])
            manager.run(gm)
            counts = next(r for r in manager.records if r.name == VAEParallel.name).result.counts
            gm.meta["vae_parallel"] = {"kind": kind, "rows": rows, "rank": rank, **counts}
            self._managers[key] = manager
            self._reports[key] = {**vae_ops.activation_memory(full), **vae_ops.census(full)}
            self._graphs[key] = gm
        return gm

    def report(self) -> Dict[str, Any]:
        """Per graph: rows per rank, inserted collectives, and activation bytes on this rank against the
        same call captured on the full input (what one process would hold), from the graphs' shapes."""
        out = {}
        for key, gm in self._graphs.items():
            mine, single = vae_ops.activation_memory(gm), self._reports[key]
            out[f"{key[0]}{list(key[1])}"] = {
                **gm.meta["vae_parallel"], "world_size": self._group.size(),
                **{f"rank_{k}": v for k, v in mine.items()}, **{f"single_{k}": v for k, v in single.items()},
                "peak_ratio": mine["peak_activation_bytes"] / max(1, single["peak_activation_bytes"])}
        return out


def parallel_vae(vae: torch.nn.Module, size: int, group: Optional[dist.ProcessGroup] = None,
                 then: Optional[Callable[[], Sequence[Pass]]] = None):
    """Split ``vae``'s decode / encode over ``size`` ranks of ``group`` (default: the world group); ``then()``:
    further passes for each graph after the split (a quantization).

    ``size=1`` returns ``vae`` itself (nothing to split), or with ``then`` a :class:`VAEGraphs`. Otherwise
    ``size`` must equal the group's size and a process group must be initialised. The result is a
    :class:`ParallelVAE`; every rank must call it with the same input, and every rank receives the full output."""
    check_ranks("parallel_vae(size)", size)
    if size == 1:
        return vae if then is None else VAEGraphs(vae, then)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"parallel_vae(size={size}) needs a torch.distributed process group: call "
                           f"torch.distributed.init_process_group(...) on every rank first")
    group = group if group is not None else dist.group.WORLD
    if group.size() != size:
        raise ValueError(f"parallel_vae: size={size}, but the process group has {group.size()} ranks; "
                         f"pass size={group.size()} or a group of {size} ranks")
    return ParallelVAE(vae, group, then)
