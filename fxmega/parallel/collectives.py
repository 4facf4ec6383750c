"""Bucketed collectives over lists of tensors, written with functional collectives so that
they trace into the compiled step,.

Many tensors are sent as one message per bucket (Megatron's ``--ddp-bucket-size``), not one
per tensor: tensors are packed into a flat buffer, reduced or gathered once, and unpacked.
Sharded tensors are split along their own dim ``d`` (not necessarily dim 0): packing lays
each tensor out as ``[world, rest]`` with row ``r`` holding rank ``r``'s slice, so one
reduce-scatter or all-gather serves tensors sharded along different dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

Group = Any  # a 1-D DeviceMesh or a ProcessGroup

# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def buckets(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """Group tensor indices into buckets of at most ``bucket_numel`` elements, in reverse
    order (the order backward produces gradients); a tensor larger than a bucket travels
    alone. ``bucket_numel <= 0`` puts everything in one bucket."""
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        if current and bucket_numel > 0 and size + numels[i] > bucket_numel:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
    if current:
        out.append(current)
    return out


def split_rows(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """``t`` as ``[world, rest]``: row r is the r-th of ``world`` equal chunks along ``dim``."""
    shape = list(t.shape)
    rows = shape[dim] // world
    t = t.reshape(shape[:dim] + [world, rows] + shape[dim + 1:])
    return t.movedim(dim, 0).reshape(world, -1)


def join_rows(rows: torch.Tensor, shard_shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Inverse of ``split_rows``: ``[world, numel(shard)]`` → the full tensor, the world's
    shards concatenated along ``dim``."""
    world = rows.shape[0]
    t = rows.reshape((world, *shard_shape)).movedim(0, dim)
    full = list(shard_shape)
    full[dim] *= world
    return t.reshape(full)


def all_reduce(tensors: list[torch.Tensor], group: Group, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Sum ``tensors`` over ``group`` with one collective (sent as ``dtype`` if given,
    returned in each tensor's own dtype)."""
    flat = torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])
    flat = funcol.all_reduce(flat, "sum", group)
    return [piece.view_as(t).to(t.dtype) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def reduce_scatter(tensors: list[torch.Tensor], dims: list[int], world: int, group: Group,
                   dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Sum over ``group`` and keep this rank's slice of each tensor along its dim, with one
    collective (sent as ``dtype`` if given). Returns the shards (shape of each tensor with
    ``dims[i]`` divided by world), each in its tensor's dtype."""
    packed = torch.cat([split_rows(t.to(dtype or t.dtype), d, world) for t, d in zip(tensors, dims)], dim=1)
    mine = _reduce_scatter_single(packed.reshape(-1), "sum", 0, group)
    out = []
    for piece, t, d in zip(mine.split([t.numel() // world for t in tensors]), tensors, dims):
        shape = list(t.shape)
        shape[d] //= world
        out.append(piece.reshape(shape).to(t.dtype))  # a row of split_rows is the shard in row-major order
    return out


def all_gather(shards: list[torch.Tensor], dims: list[int], world: int, group: Group) -> list[torch.Tensor]:
    """Concatenate every rank's shard of each tensor along its dim, with one collective."""
    flat = torch.cat([s.reshape(-1) for s in shards])
    gathered = _all_gather_single(flat, 0, group).reshape(world, -1)
    out, offset = [], 0
    for s, d in zip(shards, dims):
        n = s.numel()
        out.append(join_rows(gathered[:, offset:offset + n], tuple(s.shape), d))
        offset += n
    return out


def reduce_scatter_flat(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum a 1-D buffer (its length a multiple of the group's size) over ``group``; this
    rank's contiguous part of the sum."""
    return _reduce_scatter_single(flat, "sum", 0, group)


def all_gather_flat(flat: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's 1-D buffer, concatenated in group order."""
    return _all_gather_single(flat, 0, group)
