"""The op taxonomy every sharding rule table reads: each class of ATen overloads once.
"""
from __future__ import annotations

import operator

import torch

from ..capture_opaque import OPAQUE_MODULE_OP

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

SDPA = aten.scaled_dot_product_attention.default
LINEAR = aten.linear.default
GETITEM = operator.getitem
# views whose argument 1 is the full output size list
SIZE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# every op that only re-indexes a value row-major (same elements, same order)
RESHAPES = SIZE_VIEWS | {aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim,
                         aten.squeeze.dims, aten.squeeze.default}
COMPLEX_VIEWS = {aten.view_as_complex.default, aten.view_as_real.default}
# output shaped like argument 0; other tensor arguments (type_as's) lend only a dtype
LIKE_ARG0 = {aten.dropout.default, aten.type_as.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
             aten.to.device, aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
             aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
             aten.rand_like.default, aten.randn_like.default, aten.lift_fresh_copy.default}
# the tensor argument 1 lends only a dtype / shape; outputs that do not depend on argument 0's values
META_ARG1 = {aten.type_as.default, aten.expand_as.default}
# new tensors of a given size: argument 0 lends only a dtype / device (the output is a constant of that size)
NEW_TENSORS = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
               aten.new_empty_strided.default}
VALUE_FREE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
              aten.rand_like.default, aten.randn_like.default}
# elementwise ops that are finite wherever their operands are (activations, +, -, *): a zero-padded MLP
# hidden stays finite through them, so the down projection's zero columns cancel it exactly
FINITE_POINTWISE = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
                    aten.mul.Scalar, aten.neg.default, aten.silu.default, aten.gelu.default, aten.relu.default,
                    aten.sigmoid.default, aten.tanh.default, aten.clamp.default, aten.clamp_min.default,
                    aten.clamp_max.default, aten.abs.default, aten.erf.default, aten.leaky_relu.default,
                    aten.hardtanh.default, aten.hardswish.default, aten.hardsigmoid.default, aten.elu.default,
                    aten.softplus.default, aten.mish.default, aten.pow.Tensor_Scalar}
# elementwise ops finite and real only on positive inputs (zero-padded heads must be provably positive: tp_heads)
INVERSES = {aten.rsqrt.default, aten.reciprocal.default, aten.sqrt.default}
# tensor parallelism's collectives run over ranks that hold the same tokens: elementwise for sequence sharding
ELEMENTWISE_COLLECTIVES = {c10d.all_reduce.default, c10d.wait_tensor.default}
EXPANDS = {aten.expand.default, aten.expand_as.default}
COPIES = {aten.copy_.default, aten.copy.default}
# reduction -> (position of its dims argument, the collective that completes it across shards, or None)
REDUCTIONS = {aten.sum.dim_IntList: (1, "sum"), aten.mean.dim: (1, "sum"), aten.amax.default: (1, "max"),
              aten.amin.default: (1, "min"), aten.var.correction: (1, None), aten.std.correction: (1, None),
              aten.var.dim: (1, None), aten.std.dim: (1, None), aten.linalg_vector_norm.default: (2, None)}
SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int}
# (x, sizes or count, dim): pieces along dim
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.split.sizes, aten.chunk.default}
LAYER_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default}
CONVS = {aten.conv2d.default, aten.conv3d.default}
NEAREST_UPSAMPLES = {aten.upsample_nearest2d.vec, aten._upsample_nearest_exact2d.vec}
PADS = {aten.pad.default, aten.constant_pad_nd.default}
# ops that write at indices (global positions along a dim: the index tensors do not follow a shard)
SCATTERS = {aten.scatter_add.default, aten.scatter_add_.default, aten.scatter.src, aten.scatter.value,
            aten.scatter_reduce.two, aten.index_add.default, aten.index_put.default, aten.index_put_.default,
            aten.index_copy.default, aten.masked_scatter.default}
# ops that mix every position of a dim (or gather / scatter by index): never local on a sharded dim
MIXING = CONVS | SCATTERS | {aten.conv1d.default, aten.conv1d.padding, aten.convolution.default,
                             aten.group_norm.default, aten.mean.default, aten.sum.default, aten.cumsum.default,
                             aten.index_select.default, aten.gather.default, aten.index.Tensor, aten.sort.default,
                             aten.topk.default}
MATMULS = {aten.matmul.default, aten.bmm.default}
# a submodule capture could not trace, run eagerly as one op (``capture_opaque``): what it computes is not in the
# graph, so nothing shows that it acts token by token
OPAQUE_MODULE = OPAQUE_MODULE_OP
# attention whose score / mask functions (and block mask) index the global query and key positions
FLEX_ATTENTION = torch.ops.higher_order.flex_attention
# higher-order ops that call a body graph under a context (autocast, grad mode): position of the body argument,
# the body's operands follow it
CONTEXT_WRAPPERS = {torch.ops.higher_order.wrap_with_autocast: 4, torch.ops.higher_order.wrap_with_set_grad_enabled: 1}
# ops whose output shares its input's storage (activation accounting)
ALIASES = SIZE_VIEWS | {aten.transpose.int, aten.permute.default, aten.slice.Tensor, aten.select.int,
                        aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default,
                        aten.detach.default, aten.dropout.default, aten.chunk.default, operator.getitem}


# elementwise, though ATen does not tag them pointwise (the operators ``|`` / ``&`` of Python code)
UNTAGGED_POINTWISE = {aten.__or__.Tensor, aten.__or__.Scalar, aten.__and__.Tensor, aten.__and__.Scalar}


def is_pointwise(target) -> bool:
    return target in UNTAGGED_POINTWISE or (isinstance(target, torch._ops.OpOverload)
                                            and torch.Tag.pointwise in target.tags)
