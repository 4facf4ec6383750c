"""ZeRO-3 / FSDP: gather a block's parameters just before the block runs, and free them
after, in the forward and again in the backward.

Parameters are stored sharded over the data axes. ``gathered_call`` runs one piece of the
model (the embedding, a block, the head) inside ``torch.utils.checkpoint`` with a selective
policy: the all-gather, its wait and the copies that unpack it are *recomputed* in the
backward, while everything the model computes is saved as usual. So the full parameters of
a block exist only while that block runs, in either pass — measured here, the whole-step
compiled graph otherwise keeps every gathered parameter alive from the forward to the
backward (torchtitan's SimpleFSDP policy alone does not free them in a graph that also
traces ``autograd.grad``: the views of the gathered weights must be recomputed too).

The gather is one collective per piece (the piece is the bucket); its backward is one
reduce-scatter of the piece's gradients, so gradients come back already sharded.

With ``compute.fp8_gather`` the weights the tensorwise fp8 recipe casts travel in fp8
(``GatherShardsFp8``, as torchao's float8 all-gather for FSDP2): each rank casts its shard
with the scale of the whole weight (one all-reduce of the pieces' amaxes), the gather moves
one byte per element, and the weight is dequantised on arrival, so the matmul's own cast
finds the same fp8 values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxmega.ops import fp8
from fxmega.ops import recompute as block_recompute
from fxmega.ops.phases import backward_phase
from fxmega.parallel.collectives import all_gather, reduce_scatter

_ops = torch.ops
# Produced by gathering and unpacking parameters; cheap to redo, expensive to keep.
_RECOMPUTE = {
    _ops._c10d_functional.all_gather_into_tensor.default,
    _ops._c10d_functional.wait_tensor.default,
    _ops.aten.cat.default,
    _ops.aten.clone.default,
    _ops.aten._to_copy.default,
    _ops.aten.copy.default,
    # reshape of a non-contiguous tensor is clone + _unsafe_view, and _unsafe_view is not
    # flagged as a view: kept, it would keep the gathered parameter alive until the backward
    _ops.aten._unsafe_view.default,
    # tensors made from nothing but a shape: free to make again, and an eager composite may
    # fill one in place after it is made (F.one_hot: zeros, then scatter_), which a saved
    # copy refuses ("Tensor cached during selective activation checkpoint has been mutated")
    _ops.aten.new_zeros.default,
    _ops.aten.new_ones.default,
    _ops.aten.new_full.default,
    _ops.aten.new_empty.default,
    _ops.aten.zeros_like.default,
    _ops.aten.ones_like.default,
    _ops.aten.full_like.default,
    _ops.aten.empty_like.default,
}


def _recomputed(func: Any, args: tuple) -> bool:
    """Gathers, their unpacking, views, tensors made from a shape alone (``aten.zeros``,
    ``aten.arange``: no tensor argument) and what an eager composite writes into them in
    place (``scatter_``); never a random draw (``bernoulli_`` included), which must not be
    redrawn."""
    if block_recompute.draws_random(func):
        return False
    if func in _RECOMPUTE or getattr(func, "is_view", False) or func._schema.is_mutable:
        return True
    # the fp8 gather's casts (``ops.fp8``): foreach ops, which no model piece uses itself
    if func._schema.name.startswith("aten::_foreach_"):
        return True
    return not any(isinstance(a, torch.Tensor) for a in args)  # made from nothing but a shape


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if _recomputed(func, args) else CheckpointPolicy.MUST_SAVE


def _with_mode(mode: str) -> Callable[..., CheckpointPolicy]:
    """The gather policy combined with a block recompute mode (``fxmega.ops.recompute``): the
    gathers are recomputed in any case; everything else as the mode says."""
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _recomputed(func, args):
            return CheckpointPolicy.MUST_RECOMPUTE
        return block_recompute.POLICIES[mode](ctx, func, *args, **kwargs)
    return policy


_POLICIES = {"none": _policy, "selective": _with_mode("selective"), "full": _with_mode("full")}


# Module level on purpose: a context_fn defined inside the compiled function is not
# supported by dynamo.
def _context() -> Any:
    return create_selective_checkpoint_contexts(_POLICIES["none"])


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_POLICIES["selective"])


def _full_context() -> Any:
    return create_selective_checkpoint_contexts(_POLICIES["full"])


_CONTEXTS = {"none": _context, "selective": _selective_context, "full": _full_context}


class GatherShards(torch.autograd.Function):
    """All-gather shards (each along its own dim) in one collective, cast to the compute
    dtype first (a bf16 run gathers half the bytes, like FSDP2's ``param_dtype``); backward
    reduce-scatters the gradients the same way, in ``reduce_dtype``, and hands back
    gradients in the shards' own (fp32) dtype."""

    @staticmethod
    def forward(ctx: Any, dims: tuple[int, ...], world: int, group: Any, dtype: torch.dtype,
                reduce_dtype: torch.dtype, *shards: torch.Tensor) -> tuple:
        ctx.dims, ctx.world, ctx.group, ctx.reduce_dtype = dims, world, group, reduce_dtype
        ctx.shard_dtypes = [s.dtype for s in shards]
        return tuple(all_gather([s.to(dtype) for s in shards], list(dims), world, group))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, *_scattered_gradients(ctx, grads))


def _scattered_gradients(ctx: Any, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The gathers' backward: the gradients reduce-scattered back to the shards, in their dtype."""
    # Traced apart from the rest of the backward, so it must carry the backward-phase
    # annotation itself, or the backward splits into regions the recompute pass refuses.
    with backward_phase():
        shards = reduce_scatter(list(grads), list(ctx.dims), ctx.world, ctx.group, ctx.reduce_dtype)
    return [s.to(d) for s, d in zip(shards, ctx.shard_dtypes)]


class GatherShardsFp8(torch.autograd.Function):
    """``GatherShards`` for weights the tensorwise fp8 recipe casts: the shards travel as e4m3
    bytes with the whole weights' scales (amaxes maxed over ``amax_group``: the gather's
    ranks, and tp's where tp splits the weight too) and arrive dequantised to ``dtype``; the
    backward is ``GatherShards``' (the cast passes gradients through, as torchao's does)."""

    @staticmethod
    def forward(ctx: Any, dims: tuple[int, ...], world: int, group: Any, amax_group: Any, dtype: torch.dtype,
                reduce_dtype: torch.dtype, *shards: torch.Tensor) -> tuple:
        ctx.dims, ctx.world, ctx.group, ctx.reduce_dtype = dims, world, group, reduce_dtype
        ctx.shard_dtypes = [s.dtype for s in shards]
        return tuple(_gather_fp8(dims, world, group, amax_group, dtype, *shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None, None, *_scattered_gradients(ctx, grads))


def _gather_fp8(dims: tuple[int, ...], world: int, group: Any, amax_group: Any, dtype: torch.dtype,
                *shards: torch.Tensor) -> list[torch.Tensor]:
    weights = [s.to(dtype) for s in shards]  # cast from the compute dtype, as the matmul casts its weight
    scales = fp8.tensorwise_scales(weights, lambda amax: funcol.all_reduce(amax, "max", amax_group))
    gathered = all_gather(fp8.to_fp8_bits(weights, scales), list(dims), world, group)
    return fp8.from_fp8_bits(gathered, scales, dtype)


def _gather_fp8_for_forward_only(dims: tuple[int, ...], world: int, group: Any, amax_group: Any, dtype: torch.dtype,
                                 reduce_dtype: torch.dtype, *shards: torch.Tensor) -> tuple:
    """``GatherShardsFp8``'s forward alone, for a forward that needs no gradients."""
    return tuple(_gather_fp8(dims, world, group, amax_group, dtype, *shards))


def _gather_for_forward_only(dims: tuple[int, ...], world: int, group: Any, dtype: torch.dtype,
                             reduce_dtype: torch.dtype, *shards: torch.Tensor) -> tuple:
    """``GatherShards``' forward alone, for a forward that needs no gradients."""
    return tuple(all_gather([s.to(dtype) for s in shards], list(dims), world, group))


Gather = tuple[tuple[str, ...], int, Any]  # (the data axes, their size, their group)
Fp8Gather = tuple[tuple[str, ...], Any]  # (the axes a weight's pieces are spread over, their group): amaxes' all-reduce


def gathered_call(fn: Callable[..., Any], leaves: list[torch.Tensor], dims: list[int | None],
                  gathers: list[Gather | None], rebuild: Callable[[list[torch.Tensor]], Any], *args: Any,
                  regather: bool = True, recompute: str = "none", dtype: torch.dtype = torch.float32,
                  reduce_dtype: torch.dtype = torch.float32, fp8_gathers: list[Fp8Gather | None] | None = None) -> Any:
    """``fn(rebuild(full_leaves), *args)`` with the sharded leaves (``dims[i]`` not None)
    gathered over ``gathers[i]`` (``(axes, world, group)``; one collective per group: under
    expert parallelism a block's experts gather over fewer ranks than its dense weights)
    inside a checkpoint that recomputes the gathers in the backward, and all leaves cast to
    ``dtype``. ``recompute`` adds a block recompute mode to the same checkpoint.
    ``regather=False`` skips the checkpoint (the gathered parameters then stay alive until
    the backward; kept for measuring what the recompute saves). A leaf with an
    ``fp8_gathers[i]`` travels in fp8 (``GatherShardsFp8``), its amax maxed over that group."""
    fp8_gathers = fp8_gathers or [None] * len(leaves)
    # the sharded leaves of each (gather axes, fp8 amax axes) pair, in leaf order
    by_group: dict[tuple[tuple[str, ...], tuple[str, ...] | None], list[int]] = {}
    for i, d in enumerate(dims):
        if d is not None:
            by_group.setdefault((gathers[i][0], fp8_gathers[i][0] if fp8_gathers[i] else None), []).append(i)

    # evaluation and generation (no_grad) gather without the autograd Function: dynamo
    # cannot trace its ctx there, and there is no backward to reduce-scatter for
    grad = torch.is_grad_enabled()
    gather = GatherShards.apply if grad else _gather_for_forward_only
    gather_fp8 = GatherShardsFp8.apply if grad else _gather_fp8_for_forward_only

    def run(*flat: Any) -> Any:
        call_args, params = flat[:len(args)], list(flat[len(args):])
        params = [p if dims[i] is not None else p.to(dtype) for i, p in enumerate(params)]
        for (_, amax_axes), members in by_group.items():
            _, world, group = gathers[members[0]]
            dims_of, shards = tuple(dims[i] for i in members), (params[i] for i in members)
            if amax_axes is None:
                full = gather(dims_of, world, group, dtype, reduce_dtype, *shards)
            else:
                full = gather_fp8(dims_of, world, group, fp8_gathers[members[0]][1], dtype, reduce_dtype, *shards)
            for i, t in zip(members, full):
                params[i] = t
        return fn(rebuild(params), *call_args)

    if not torch.is_grad_enabled():
        # evaluation and generation: no backward, so nothing to recompute (and dynamo cannot
        # trace a checkpoint region under no_grad: evaluation of a ZeRO-3 run failed there)
        return run(*args, *leaves)
    if not regather:
        if recompute != "none":
            raise ValueError("parallel.zero3_regather=false keeps gathered parameters for measurements; "
                             "it does not combine with compute.recompute")
        return run(*args, *leaves)
    return checkpoint(block_recompute.in_forward_context(run), *args, *leaves, use_reentrant=False,
                      context_fn=_CONTEXTS[recompute])
