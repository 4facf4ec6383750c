"""Megatron-LM's distributed optimizer: ZeRO-1/2 over flat buffers rather than along a dim.

The gradients a data group sums are packed, bucket by bucket (backward order, at most
``--ddp-bucket-size`` elements each), into one flat buffer padded to a multiple of the
group's size. A reduce-scatter leaves each rank one contiguous ``1/world`` of every bucket;
the rank keeps AdamW moments for that range only and updates it, and an all-gather of the
updated ranges refreshes every replica. A parameter's shape plays no part, so any data size
shards any model — the per-dim layout (``ParamLayout.zero_dim``) needs the data size to
divide each parameter's ``embed`` dim, which Megatron's own dp=48 layouts do not.

A rank's range of a bucket cuts across parameters, so it is held as *segments*: pieces
``(tensor, start, length)`` of the flattened local parameters. The update runs over the
segments (views into the parameters), so a segment list stands where the per-tensor list
stands in ``fxmega.training.update``; ``owners`` maps each segment to its parameter (a
parameter lies in one bucket and a rank's range is contiguous: at most one segment each).
Parameters that need their whole gradient (a ``sign_rate`` bias: its update compares every
expert's load) and those with no replicas stay whole: one segment each, the tensor itself.

An optimizer that updates each hidden matrix whole (Muon's orthogonalisation) cannot take a
range that cuts a matrix. Those matrices go into buckets of their own, packed **by owner**,
as Megatron-Core's layer-wise distributed optimizer assigns them: each matrix belongs to one
rank of the group (largest first onto the least loaded rank), the buffer is every rank's
owned matrices in turn, each rank's part padded to the largest, so the same reduce-scatter
hands each owner its matrices' summed gradients whole and the same all-gather returns the
updated ones. Each matrix is orthogonalised once, by its owner, rather than on every rank;
the padding (at most one matrix per rank) is what the balance costs, and ``plan`` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.parallel import collectives
from fxmega.parallel.collectives import Group
from fxmega.parallel.groups import ProcessGroups
from fxmega.sharding.plan import ParamLayout


@dataclass(frozen=True)
class Segment:
    """``length`` elements of local parameter ``tensor`` from ``start`` (flattened); a
    negative ``start`` means the whole tensor in its own shape."""

    tensor: int
    start: int
    length: int
    shaped: bool = False  # an owned tensor, all of it: seen in its own shape (by-owner buckets)

    @property
    def whole(self) -> bool:
        return self.start < 0


def owned_segments(members: list[int], numels: list[int], world: int, index: int) -> tuple[list[Segment], int]:
    """The pieces of the tensors ``members`` (of ``numels`` elements, packed in this order and
    padded to a multiple of ``world``) that rank ``index`` of ``world`` owns: its contiguous
    ``1/world`` of the buffer. Returns the segments and the padding the range ends with."""
    total = sum(numels)
    shard = -(-total // world)
    lo, hi = index * shard, (index + 1) * shard
    out, offset = [], 0
    for i, n in zip(members, numels):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append(Segment(i, a - offset, b - a))
        offset += n
    return out, shard - sum(s.length for s in out)


def owner_packing(numels: list[int], world: int) -> list[list[int]]:
    """Which of the tensors of ``numels`` elements each of ``world`` ranks owns whole: the
    largest first onto the least loaded rank (ties: the lowest), each rank's in the given
    order. Deterministic, so every rank computes every rank's share."""
    loads, owned = [0] * world, [[] for _ in range(world)]
    for k in sorted(range(len(numels)), key=lambda k: (-numels[k], k)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owned[r].append(k)
        loads[r] += numels[k]
    return [sorted(o) for o in owned]


def owner_share(numels: list[int], packing: list[list[int]]) -> int:
    """Elements of each rank's part of a by-owner buffer: the most loaded rank's share."""
    return max(sum(numels[k] for k in ks) for ks in packing)


def owner_buffer_numel(numels: list[int], world: int) -> int:
    """Elements of a by-owner bucket's buffer: ``world`` times the largest rank's share."""
    return world * owner_share(numels, owner_packing(numels, world))


@dataclass(frozen=True)
class FlatBucket:
    """One flat buffer: the tensors ``members`` summed over ``group`` (``world`` ranks), this
    rank owning ``segments`` and then ``pad`` zeros. ``by_owner``: for each rank, the
    positions in ``members`` of the tensors it owns whole (None: the buffer is the members
    in order, each rank owning a contiguous ``1/world`` of it)."""

    group: Group
    world: int
    members: tuple[int, ...]
    numels: tuple[int, ...]
    segments: tuple[Segment, ...]
    pad: int
    by_owner: tuple[tuple[int, ...], ...] | None = None

    @property
    def shard(self) -> int:
        return sum(s.length for s in self.segments) + self.pad

    def _order(self) -> list[tuple[int | None, int]]:
        """The buffer's pieces in order: (position in ``members``, or None for zeros; length)."""
        if self.by_owner is None:
            return [*((k, n) for k, n in enumerate(self.numels)),
                    (None, self.world * self.shard - sum(self.numels))]
        out: list[tuple[int | None, int]] = []
        for ks in self.by_owner:
            out += [(k, self.numels[k]) for k in ks]
            out.append((None, self.shard - sum(self.numels[k] for k in ks)))
        return out

    def pack(self, flat: list[torch.Tensor]) -> torch.Tensor:
        """The buffer of the members' flattened tensors ``flat`` (in ``members`` order)."""
        ref = flat[0]
        return torch.cat([flat[k] if k is not None else ref.new_zeros(n) for k, n in self._order() if n])

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The members' flattened tensors, from a whole buffer."""
        order = [(k, n) for k, n in self._order() if n]
        out: list[torch.Tensor] = [buffer] * len(self.members)
        for (k, _), piece in zip(order, buffer.split([n for _, n in order])):
            if k is not None:
                out[k] = piece
        return out


class FlatOptimizerShards:
    """The buckets of ``layouts`` (this rank's parameters, in leaf order) over ``groups``:
    tensors summed over the same data axes share buckets of ``bucket_numel`` elements (0:
    one per axes), except those ``whole`` marks, which the caller all-reduces, and those
    ``owned`` marks (updated whole: a whole-matrix optimizer's hidden matrices), which get
    by-owner buckets of their own.
    ``segments`` is what the update runs over: whole tensors first, in leaf order, then each
    bucket's owned pieces."""

    def __init__(self, groups: ProcessGroups, layouts: list[ParamLayout], whole: list[bool],
                 bucket_numel: int = 0, owned: list[bool] | None = None) -> None:
        self.numels = [lay.local_numel("grad") for lay in layouts]
        owned = owned or [False] * len(layouts)
        by_axes: dict[tuple[tuple[str, ...], bool], list[int]] = {}
        kept = []
        for i, lay in enumerate(layouts):
            axes = lay.replica_axes(groups.data_axes)
            if axes and not whole[i]:
                by_axes.setdefault((axes, owned[i]), []).append(i)
            else:
                kept.append(i)
        self.buckets: list[FlatBucket] = []
        for (axes, by_owner), idx in sorted(by_axes.items()):
            world = groups.size(axes)
            index = 0
            for axis in axes:  # the group's order: its axes in physical order, the first slowest
                index = index * groups.mesh.size(axis) + groups.coords[axis]
            for bucket in collectives.buckets([self.numels[i] for i in idx], bucket_numel):
                members = [idx[b] for b in bucket]
                numels = [self.numels[i] for i in members]
                if by_owner:
                    packing = owner_packing(numels, world)
                    shard = owner_share(numels, packing)
                    segments = [Segment(members[k], 0, numels[k], shaped=True) for k in packing[index]]
                    pad = shard - sum(s.length for s in segments)
                    packed = tuple(tuple(ks) for ks in packing)
                else:
                    segments, pad = owned_segments(members, numels, world, index)
                    packed = None
                self.buckets.append(FlatBucket(groups.group(axes), world, tuple(members), tuple(numels),
                                               tuple(segments), pad, packed))
        self.segments: list[Segment] = [Segment(i, -1, self.numels[i]) for i in kept]
        for b in self.buckets:
            self.segments += b.segments
        self.owners = [s.tensor for s in self.segments]
        self.n_whole = len(kept)  # the whole tensors' segments come first

    # -- gradients, parameters and moments as segments ---------------------------------
    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each segment of per-parameter ``tensors`` (parameters: views, updated in place)."""
        return [tensors[s.tensor] if s.whole or s.shaped else tensors[s.tensor].view(-1).narrow(0, s.start, s.length)
                for s in self.segments]

    def reduce_scatter(self, grads: list[torch.Tensor], reduce_dtype: torch.dtype | None = None
                       ) -> list[torch.Tensor]:
        """Per-parameter gradients -> the segments' summed gradients (whole tensors as given:
        the caller has reduced them), one reduce-scatter per bucket."""
        out = [grads[s.tensor] for s in self.segments[:self.n_whole]]
        for b in self.buckets:
            dtype = reduce_dtype or grads[b.members[0]].dtype
            mine = collectives.reduce_scatter_flat(b.pack([grads[i].reshape(-1).to(dtype) for i in b.members]),
                                                   b.group)
            pieces = mine.split([s.length for s in b.segments] + [b.pad])
            out += [p.to(grads[s.tensor].dtype).view(grads[s.tensor].shape if s.shaped else (s.length,))
                    for p, s in zip(pieces, b.segments)]
        return out

    def all_gather(self, segments: list[torch.Tensor], shapes: list[tuple[int, ...]],
                   forward_order: bool = False) -> dict[int, torch.Tensor]:
        """The segments of every rank gathered back into per-parameter tensors of local
        ``shapes``: parameter index -> tensor (the whole ones are the segments themselves).
        One all-gather per bucket, in bucket (backward) order or, ``forward_order``, reversed."""
        out = {s.tensor: t for s, t in zip(self.segments[:self.n_whole], segments[:self.n_whole])}
        starts, at = [], self.n_whole
        for b in self.buckets:
            starts.append(at)
            at += len(b.segments)
        order = list(zip(self.buckets, starts))
        for b, at in order[::-1] if forward_order else order:
            mine = segments[at:at + len(b.segments)]
            parts = [t.reshape(-1) for t in mine]
            if b.pad:  # zeros like any segment (a rank owns at least one element of the model)
                parts.append(segments[0].new_zeros(b.pad))
            full = collectives.all_gather_flat(torch.cat(parts), b.group)
            for i, piece in zip(b.members, b.unpack(full)):
                out[i] = piece.view(shapes[i])
        return out

    def shapes(self, param_shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Each segment's shape (``param_shapes``: the parameters' local shapes)."""
        return [param_shapes[s.tensor] if s.whole or s.shaped else (s.length,) for s in self.segments]
