"""Gradient synchronisation over the data axes, inside the compiled step: which gradients
go in which bucket of which collective, decided once in plain Python so that the traced
code only walks lists.

Per micro batch, gradients sharded beyond their parameters (ZeRO-2's dp) are
reduce-scattered; after the last one, the rest is reduce-scattered onto the optimizer
shards (ZeRO-1's dp) and all-reduced over the axes that hold replicas (plain data
parallelism). After a ZeRO-1/2 update, the updated shards are all-gathered back.

With the distributed optimizer (``Strategy.flat``) the sums over replicas are instead
reduce-scattered as flat buckets (``fxmega.parallel.flat_optimizer``) and the update runs
over the segments this rank owns; ``owners`` says whose parameter each is.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from fxmega.parallel import collectives
from fxmega.parallel.flat_optimizer import FlatOptimizerShards
from fxmega.parallel.groups import ProcessGroups
from fxmega.sharding.plan import ParamLayout

# one bucket's collective: (op, group, group size, tensor indices, the dims it splits)
Bucket = tuple[str, DeviceMesh, int, list[int], list]


class GradientSync:
    """The bucketed collectives for ``layouts`` (this rank's parameters, in leaf order) over
    ``groups``; ``bucket_numel`` elements per bucket (0: one tensor per bucket) and
    reductions in ``reduce_dtype``. ``flat``: the distributed optimizer's flat buckets for
    the sums over replicas, except for the tensors ``whole`` marks (all-reduced), and with
    the tensors ``owned`` marks (updated whole: Muon's matrices) in by-owner buckets; with
    ``flat_grads`` (its ZeRO-2) they are reduce-scattered per micro batch and accumulated
    as this rank's segments."""

    def __init__(self, groups: ProcessGroups, layouts: list[ParamLayout], bucket_numel: int = 0,
                 reduce_dtype: torch.dtype = torch.float32, flat: bool = False,
                 whole: list[bool] | None = None, flat_grads: bool = False,
                 owned: list[bool] | None = None) -> None:
        self.groups, self.layouts = groups, layouts
        self.flat_grads = flat and flat_grads
        self.bucket_numel, self.reduce_dtype = bucket_numel, reduce_dtype
        extra = lambda lay, kind, base: tuple(a for a in lay.data_axes[kind] if a not in lay.data_axes[base])  # noqa
        data_axes = groups.data_axes
        whole = whole or [False] * len(layouts)
        self.flat = FlatOptimizerShards(groups, layouts, whole, bucket_numel, owned) if flat else None
        # the flat buckets take the sums over replicas of all but the whole tensors
        in_buckets = {i for b in self.flat.buckets for i in b.members} if self.flat is not None else set()
        self._micro = self._schedule([("reduce_scatter", extra(lay, "grad", "param")) for lay in layouts])
        self._scatter = self._schedule([("reduce_scatter", extra(lay, "opt", "grad")) for lay in layouts])
        self._replica = self._schedule([("all_reduce", () if i in in_buckets else lay.replica_axes(data_axes))
                                        for i, lay in enumerate(layouts)])
        self._refresh = self._schedule([("all_gather", extra(lay, "opt", "param")) for lay in layouts])
        self._opt_slices = [self._opt_slice(lay) for lay in layouts]
        # the parameter each optimizer view belongs to
        self.owners: list[int] = self.flat.owners if self.flat is not None else list(range(len(layouts)))

    def _schedule(self, ops: list[tuple[str, tuple[str, ...]]]) -> list[Bucket]:
        """The buckets of per-tensor ops ``(op, axes)`` (no axes: nothing to do)."""
        out = []
        for op, axes in sorted({o for o in ops if o[1]}):
            idx = [i for i, o in enumerate(ops) if o == (op, axes)]
            numels = [self.layouts[i].local_numel("grad") for i in idx]
            for bucket in collectives.buckets(numels, self.bucket_numel):
                members = [idx[b] for b in bucket]
                dims = [self.layouts[i].zero_dim for i in members]
                out.append((op, self.groups.group(axes), self.groups.size(axes), members, dims))
        return out

    @staticmethod
    def _run(schedule: list[Bucket], tensors: list[torch.Tensor],
             reduce_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        out = list(tensors)
        for op, group, world, members, dims in schedule:
            chunk = [tensors[i] for i in members]
            if op == "all_reduce":
                results = collectives.all_reduce(chunk, group, reduce_dtype)
            elif op == "reduce_scatter":
                results = collectives.reduce_scatter(chunk, dims, world, group, reduce_dtype)
            else:
                results = collectives.all_gather(chunk, dims, world, group)
            for i, r in zip(members, results):
                out[i] = r
        return out

    def micro_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per micro batch: reduce-scatter where gradients are sharded beyond the parameters
        (ZeRO-2's dp). What stays is accumulated locally (``accum_shapes``)."""
        if self.flat_grads:  # the buckets' segments; the whole tensors wait for ``final_grads``
            return self.flat.reduce_scatter(grads, self.reduce_dtype)
        return self._run(self._micro, grads, self.reduce_dtype)

    def accum_shapes(self) -> list[tuple[int, ...]]:
        """The shapes ``micro_grads`` returns, which the accumulation buffers take."""
        shapes = [lay.local_shape("grad") for lay in self.layouts]
        return self.flat.shapes(shapes) if self.flat_grads else shapes

    def final_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """After the last micro batch: reduce-scatter onto the optimizer shards (ZeRO-1's dp)
        and all-reduce over the data axes that hold replicas (plain data parallelism)."""
        reduce = self.reduce_dtype
        if self.flat_grads:  # the segments summed already; the whole tensors (first) all-reduced
            whole = self.flat.segments[:self.flat.n_whole]
            per_param: list = [None] * len(self.layouts)
            for seg, g in zip(whole, grads):
                per_param[seg.tensor] = g
            per_param = self._run(self._replica, per_param, reduce)
            return [per_param[seg.tensor] for seg in whole] + list(grads[len(whole):])
        grads = self._run(self._replica, self._run(self._scatter, grads, reduce), reduce)
        return grads if self.flat is None else self.flat.reduce_scatter(grads, reduce)

    def _opt_slice(self, lay: ParamLayout) -> tuple[int, int, int] | None:
        extra = [a for a in lay.data_axes["opt"] if a not in lay.data_axes["param"]]
        if not extra:
            return None
        split = self.groups.size(tuple(extra))
        index = 0
        for axis in extra:
            index = index * self.groups.mesh.size(axis) + self.groups.coords[axis]
        rows = lay.local_shape("param")[lay.zero_dim] // split
        return lay.zero_dim, index * rows, rows

    def opt_views(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The part of each local parameter this rank's optimizer shard updates (a view; with
        the distributed optimizer one per segment, see ``owners``)."""
        if self.flat is not None:
            return self.flat.views(flat)
        return [p if sl is None else p.narrow(*sl) for p, sl in zip(flat, self._opt_slices)]

    def gathered_params(self, flat: list[torch.Tensor], views: list[torch.Tensor],
                        forward_order: bool = False) -> list[torch.Tensor]:
        """The parameters with ZeRO-1/2's updated shards (``views``) all-gathered: new tensors
        for the gathered ones, ``flat``'s own for the rest. Buckets go in backward order (the
        gradients'), or with ``forward_order`` in the order the forward reads them — the
        first layers' first (``parallel.overlap_param_gather``: the gathers share a link, so
        the one needed first is sent first)."""
        out = list(flat)
        if self.flat is not None:
            full = self.flat.all_gather(views, [p.shape for p in flat], forward_order)
            for b in self.flat.buckets:
                for i in b.members:
                    out[i] = full[i]
            return out
        schedule = self._refresh[::-1] if forward_order else self._refresh
        full = self._run(schedule, views)
        for _, _, _, members, _ in schedule:
            for i in members:
                out[i] = full[i]
        return out

    def refresh_params(self, flat: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        """After a ZeRO-1/2 update: all-gather the updated shards back into every replica."""
        for p, full in zip(flat, self.gathered_params(flat, views)):
            if full is not p:
                p.copy_(full)

    def init_opt_moments(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """One optimizer state tensor per parameter of this rank (an AdamW moment): zeros
        shaped as its optimizer views."""
        shapes = [lay.local_shape("opt") for lay in self.layouts]
        return [torch.zeros(s, device=device, dtype=dtype)
                for s in (self.flat.shapes(shapes) if self.flat is not None else shapes)]

    def moments_by_param(self, moments: list[torch.Tensor]) -> list[torch.Tensor]:
        """A moment laid out per parameter in its ``opt`` layout (what checkpoints hold):
        the distributed optimizer's segments are gathered over their buckets' groups (for a
        moment, every parameter's whole moment on each replica, as Megatron's
        non-distributed save gathers them)."""
        if self.flat is None:
            return moments
        full = self.flat.all_gather(moments, [lay.local_shape("opt") for lay in self.layouts])
        # plain tensors (a clone waits for the gathers), owned by the caller: checkpoints read them
        return [full[i].clone() for i in range(len(self.layouts))]

    def moments_from_params(self, by_param: list[torch.Tensor], moments: list[torch.Tensor]) -> None:
        """Copy a per-parameter moment (``moments_by_param``'s layout) into this rank's own."""
        with torch.no_grad():
            for m, v in zip(moments, self.opt_views(by_param) if self.flat is not None else by_param):
                m.copy_(v)

    def norm_weights(self, device: torch.device) -> torch.Tensor:
        """1 where this rank's optimizer-layout gradient counts towards the global norm, 0
        where another rank holds the same values (tp or data replicas): each element once.
        One per optimizer view (``owners``): a flat bucket's ranks hold disjoint pieces."""
        weights = []
        coords = self.groups.coords
        segments = self.flat.segments if self.flat is not None else [None] * len(self.layouts)
        for i, seg in zip(self.owners, segments):
            lay = self.layouts[i]
            replicated = list(lay.replica_axes(self.groups.data_axes)) if seg is None or seg.whole else []
            if lay.tp_dim is None and self.groups.tp > 1:
                replicated.append("tp")
            if self.groups.cp > 1:  # parameters are replicated over cp
                replicated.append("cp")
            weights.append(1.0 if all(coords[a] == 0 for a in replicated) else 0.0)
        return torch.tensor(weights, device=device)
