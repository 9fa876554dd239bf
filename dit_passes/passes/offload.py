"""LayerwiseOffload: block weights live on the offload device and are loaded just before their block runs.

Phase ``OFFLOAD``: after the parallel and quantization phases (it moves the weights they produced) and
before the cache, whose cut carries each block's load into the branch with the block (so blocks the
cache skips are never loaded). Reads ``structure``; writes the fact ``offload_loads`` (load -> block).

Before (block 1 of 3)::

    w = self.transformer_blocks.1.attn.to_q.weight                # resident on the GPU
    linear_7 = torch.ops.aten.linear.default(norm_1, w, b)

After (``async_transfer=True, transfer_buckets=1``: block 1's load is issued as block 0 starts)::

    onload_1 = torch.ops.dit_passes.onload([w, b, ...], "cuda", 0)  # copies from pinned host memory
    ...  block 0 ...
    w_1 = onload_1[0]
    linear_7 = torch.ops.aten.linear.default(norm_1, w_1, b_1)     # the copy dies after its last use

Options follow cache-dit's ``layerwise_offload``: ``transfer_buckets`` blocks are prefetched ahead with
``async_transfer`` (0 without: each block loads as it starts); ``prefetch_limit`` caps that at
``min(4 * transfer_buckets, 8)``; ``max_inflight_prefetch_bytes`` caps the bytes loaded ahead of their block;
``persistent_buckets`` blocks stay resident, spread over ``persistent_bins`` even bins of the block range
(1 = the first blocks); ``max_copy_streams`` CUDA copy streams take the loads in turn.

The block weights are moved to ``offload_device`` in place (the model's own parameters, pinned when
loading onto CUDA): offloading is a property of the model's memory, not of one graph.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.facts import facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase

# device -> CUDA copy streams: a process-wide pool of CUDA resources (like the caching allocator's), no
# per-request state
_COPY_STREAMS: Dict[Any, List[Any]] = {}


@torch.library.custom_op("dit_passes::onload", mutates_args=())
def onload(weights: List[torch.Tensor], device: str, stream: int) -> List[torch.Tensor]:
    """Copies of ``weights`` on ``device``. ``stream >= 0`` (CUDA): issued on copy stream ``stream`` from
    pinned memory, the current stream waits for them (what it had queued before keeps running meanwhile)."""
    dev = torch.device(device)
    if dev.type != "cuda" or stream < 0:
        return [w.to(dev, copy=True) for w in weights]
    streams = _COPY_STREAMS.setdefault(dev, [])
    while len(streams) <= stream:
        streams.append(torch.cuda.Stream(dev))
    side, current = streams[stream], torch.cuda.current_stream(dev)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = [w.to(dev, non_blocking=True, copy=True) for w in weights]
    current.wait_stream(side)
    for t in out:
        t.record_stream(current)  # the allocator must not reuse the memory while `current` reads it
    return out


@onload.register_fake
def _(weights, device, stream):
    return [torch.empty_like(w, device=torch.device(device)) for w in weights]


def parse_bytes(value: Union[int, str, None]) -> Optional[int]:
    """``8gib`` / ``512MiB`` / ``1000000`` -> bytes (None stays None)."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*", str(value).lower())
    if not m:
        raise ValueError(f"max_inflight_prefetch_bytes={value!r}: use an int or a size like '512MiB' / '8gib'")
    unit = (m.group(2) or "b").rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
             "ti": 2 ** 40}[unit]
    return int(float(m.group(1)) * scale)


def persistent_blocks(n: int, count: int, bins: int) -> List[int]:
    """``count`` block indices spread over ``bins`` even bins of ``range(n)``, taken from each bin's start."""
    count, bins = min(count, n), max(1, min(bins, n))
    edges = [round(i * n / bins) for i in range(bins + 1)]
    per_bin = [count // bins + (1 if i < count % bins else 0) for i in range(bins)]
    return sorted(b for i in range(bins) for b in range(edges[i], min(edges[i] + per_bin[i], edges[i + 1])))


class LayerwiseOffload(Pass):
    name = "layerwise_offload"
    phase = Phase.OFFLOAD
    reads = ("structure", "offload_loads")
    writes = ("offload_loads",)
    invalidates = ("structure",)  # new load nodes between the blocks

    def __init__(self, onload_device: Union[str, torch.device, None] = None, offload_device: Union[str, torch.device] = "cpu",
                 async_transfer: bool = False, transfer_buckets: int = 1, prefetch_limit: bool = False,
                 max_copy_streams: Optional[int] = None, max_inflight_prefetch_bytes: Union[int, str, None] = None,
                 persistent_buckets: int = 0, persistent_bins: int = 1):
        for name, v, lo in (("transfer_buckets", transfer_buckets, 0), ("persistent_buckets", persistent_buckets, 0),
                            ("persistent_bins", persistent_bins, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"LayerwiseOffload: {name} must be an int >= {lo}, got {v!r}")
        if max_copy_streams is not None and (not isinstance(max_copy_streams, int) or max_copy_streams < 1):
            raise ValueError(f"LayerwiseOffload: max_copy_streams must be None or an int >= 1, got {max_copy_streams!r}")
        self.onload_device = None if onload_device is None else torch.device(onload_device)
        self.offload_device = torch.device(offload_device)
        self.async_transfer, self.prefetch_limit = bool(async_transfer), bool(prefetch_limit)
        self.transfer_buckets, self.max_copy_streams = transfer_buckets, max_copy_streams or 1
        self.max_inflight = parse_bytes(max_inflight_prefetch_bytes)
        self.persistent_buckets, self.persistent_bins = persistent_buckets, persistent_bins

    def config_items(self) -> Dict[str, Any]:
        return {"onload": str(self.onload_device), "offload": str(self.offload_device), "async": self.async_transfer,
                "ahead": self.transfer_buckets, "persistent": self.persistent_buckets}

    def _ahead(self) -> int:
        if not self.async_transfer:
            return 0
        return min(self.transfer_buckets, 4 * self.transfer_buckets, 8) if self.prefetch_limit else self.transfer_buckets

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        s = get_structure(gm)
        g = gm.graph
        device = self.onload_device or next(
            (p.meta["val"].device for p in g.nodes if p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)),
            torch.device("cpu"))
        pin = device.type == "cuda" and self.offload_device.type == "cpu"
        stream = 0 if self.async_transfer and device.type == "cuda" else -1
        keep = set(persistent_blocks(len(s.blocks), self.persistent_buckets, self.persistent_bins))
        weights = self._block_weights(gm, s)
        order = {n: i for i, n in enumerate(g.nodes)}
        loads, moved, ahead_bytes = {}, 0, []
        inflight = [0] * len(s.blocks)
        for b in s.blocks:
            if b.index in keep or not weights[b.index]:
                continue
            ws = weights[b.index]
            nbytes = sum(_val(w).numel() * _val(w).element_size() for w in ws)
            # issue the load up to `ahead` blocks early, while the bytes loaded ahead of their block and alive
            # during each earlier block stay within max_inflight_prefetch_bytes
            host = b.index
            for p in range(b.index - 1, max(-1, b.index - 1 - self._ahead()), -1):
                if self.max_inflight is not None and inflight[p] + nbytes > self.max_inflight:
                    break
                host = p
            for p in range(host, b.index):
                inflight[p] += nbytes
            first = min((n for n in s.blocks[host].nodes), key=order.__getitem__)
            for w in ws:  # get_attr nodes are pure: make sure they precede the load
                if order[w] > order[first]:
                    first.prepend(w)
            with g.inserting_before(first):
                load = g.create_node("call_function", torch.ops.dit_passes.onload.default,
                                     ([*ws], str(device), -1 if stream < 0 else b.index % self.max_copy_streams),
                                     name=f"onload_block_{b.index}")
                load.meta["val"] = [torch.empty_like(_val(w), device=device) for w in ws]
            inside = set(b.nodes)
            with g.inserting_after(load):
                for i, w in enumerate(ws):
                    item = g.create_node("call_function", operator.getitem, (load, i), name=f"{w.name}_onloaded")
                    item.meta["val"] = load.meta["val"][i]
                    w.replace_all_uses_with(item, delete_user_cb=lambda u: u in inside)
            loads[load] = b.index
            ahead_bytes.append(nbytes if host != b.index else 0)
            moved += self._offload(gm, ws, pin)
        g.lint()
        ctx.recompile_at_end(gm)
        facts_of(gm).offload_loads = loads  # the cache pass keeps each load with its block
        counts = {"blocks_offloaded": len(loads), "blocks_persistent": len(keep), "weights_offloaded": moved,
                  "prefetched_ahead": sum(1 for x in ahead_bytes if x)}
        return PassResult(bool(loads), counts, f"{len(loads)} of {len(s.blocks)} blocks load their weights onto "
                                               f"{device} before they run ({counts['prefetched_ahead']} ahead of "
                                               f"time); {len(keep)} stay resident; weights on {self.offload_device}")

    @staticmethod
    def _block_weights(gm: fx.GraphModule, s) -> Dict[int, List[fx.Node]]:
        """Per block, the get_attr tensors only that block reads (shared ones stay resident)."""
        out: Dict[int, List[fx.Node]] = {b.index: [] for b in s.blocks}
        block_of = {n: b.index for b in s.blocks for n in b.nodes}
        for n in gm.graph.nodes:
            if n.op != "get_attr" or not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            owners = {block_of.get(u) for u in n.users}
            if len(owners) == 1 and None not in owners:
                out[owners.pop()].append(n)
        return out

    def _offload(self, gm: fx.GraphModule, nodes: Sequence[fx.Node], pin: bool) -> int:
        for n in nodes:
            t = _attr(gm, n.target)
            if t.device != self.offload_device:
                data = t.data.to(self.offload_device)
                t.data = data.pin_memory() if pin else data  # the model's own tensor: every holder sees it
        return len(nodes)


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _val(n: fx.Node) -> torch.Tensor:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise PassError(f"layerwise_offload: '{n.name}' has no tensor metadata")
    return v


__all__ = ["LayerwiseOffload", "onload", "persistent_blocks", "parse_bytes"]
