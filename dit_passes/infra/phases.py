"""The phases of a dit_passes pipeline: each pass declares one, and the PassManager runs them in this order.

A phase says what kind of rewrite a pass makes, and the order follows from what each kind needs to
see in the graph:

* ``CLEANUP``: canonicalise the captured graph (drop export's metadata asserts and no-op casts).
* ``SHARD_WEIGHTS``: tensor parallelism; it reads the aten ``linear`` and attention inputs, so it runs
  before anything replaces them.
* ``SHARD_SEQUENCE``: context parallelism (and VAE-P's spatial split); replaces aten attention with
  distributed attention.
* ``FUSE_LINEARS``: merges linears that read one input into one wider linear (``FuseSiblingLinears``, opt-in).
  A phase of its own: it must see the local shards the sharding phases left (a sharded linear is still a linear
  of this rank's rows, so fusing it stays exact) and must run before ``QUANTIZE`` so the quantizers see one wider
  GEMM; putting it in either neighbour would make the order hang on the order the user listed the passes in.
* ``QUANTIZE``: replaces aten ``linear`` by quantized ops (after TP has sliced their weights).
* ``LOAD_WEIGHTS``: a model built on the meta device gets the weights that no earlier pass replaced from its
  checkpoint (``compile_dit(weights=...)``); tensor parallelism read only its slices, quantization one weight at a
  time. Before anything moves or computes from a weight.
* ``EPILOGUES``: rewrites the plain linears the quantizers left so less memory traffic surrounds their GEMMs
  (``FuseLinearGelu``: GELU in the GEMM's epilogue; ``SplitConcatLinear``: a linear over a concatenation as one GEMM
  per part, no concatenated copy). After ``QUANTIZE``, so the quantizers see the model's own linears.
* ``FUSE_POINTWISE``: replaces a chain of memory-bound ops that Inductor writes as a slow kernel by one op of ours
  (``FuseNormRope``: the q / k RMSNorm and the rotary embedding). After the sharding phases (it sees this rank's
  heads and sequence shard) and before ``CACHE`` / ``COMPILE``, which move and compile the blocks it rewrote.
* ``OFFLOAD``: moves block weights off the device and inserts their loads.
* ``ATTENTION_KERNEL``: pins the SDPA kernel of the aten attention nodes that remain.
* ``CACHE``: moves a block range into a ``torch.cond`` branch (after everything that rewrites blocks).
* ``COMPILE``: outlines blocks into compiled templates, top graph and cache branches alike.

Two passes of one phase keep the order the user gave. No pass names another pass.
"""
from __future__ import annotations

import enum


class Phase(enum.IntEnum):
    CLEANUP = 0
    SHARD_WEIGHTS = 10
    SHARD_SEQUENCE = 20
    FUSE_LINEARS = 25
    QUANTIZE = 30
    LOAD_WEIGHTS = 35
    EPILOGUES = 38
    FUSE_POINTWISE = 39
    OFFLOAD = 40
    ATTENTION_KERNEL = 50
    CACHE = 60
    COMPILE = 70
    ANALYSIS = 100  # reads the graph only; runs after every rewrite


__all__ = ["Phase"]
