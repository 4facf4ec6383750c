"""Activation layouts: the ``ActivationLayouts`` that model code's ``shard(x, *axes)`` and
``local(fn, ...)`` (``fxmega.sharding.layout``) resolve to on a mesh with tensor (tp) or
context (cp) parallelism.

Over tp, activations are DTensors on the 1-D tp mesh and each logical name is split as the
rules say (Megatron's column/row-parallel layouts, sequence parallelism with ``"seq": "tp"``),
held on purpose by an explicit ``redistribute`` (DTensor's own propagation picks slower
ones); attention-like functions run per shard with ``local_map``.

Over cp, every tensor is this rank's chunks of the sequence as a plain local tensor (as over
the data axes); the DTensors, where tp makes them, hold those chunks. Only attention reaches
across the chunks, through ``context`` (``fxmega.parallel.context.ContextParallel``): its
functional collectives run inside the local function.

Over ep, activations are plain local tensors too (each ep rank reads its own micro batches);
a MoE layer sends its tokens to the experts' ranks and back with ``all_to_all(x, "expert")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from fxmega.parallel.context import ContextParallel
from fxmega.parallel.groups import ProcessGroups
from fxmega.sharding.plan import ParamLayout, ShardingPlan
from fxmega.sharding.rules import mesh_axes_of

Axes = tuple[str | None, ...]


class ActivationLayouts:
    """Logical axis names -> placements on the tp mesh (``mesh``; None without tp), the
    context-parallel collectives attention uses (``context``; None without cp), and the
    exchanges between the ranks that split a logical axis over other mesh axes (``groups``:
    the experts over ep)."""

    def __init__(self, plan: ShardingPlan, mesh: DeviceMesh | None, context: ContextParallel | None = None,
                 groups: ProcessGroups | None = None) -> None:
        self.plan, self.mesh, self.context, self.groups = plan, mesh, context, groups

    def _exchange_axes(self, name: str) -> tuple[str, ...]:
        axes = tuple(a for a in mesh_axes_of(self.plan.strategy.rules.get(name)) if self.plan.mesh.size(a) > 1)
        if "tp" in axes:
            raise ValueError(f"all_to_all over {name!r}, which the rules split over tp: tp-split activations are "
                             f"DTensors, exchanged by shard(); all_to_all is for axes split over other mesh axes")
        return axes

    def axis_size(self, name: str) -> int:
        return math.prod([self.plan.mesh.size(a) for a in self._exchange_axes(name)])

    def all_to_all(self, x: torch.Tensor, name: str) -> torch.Tensor:
        axes = self._exchange_axes(name)
        if not axes:
            return x
        if self.groups is None:
            raise ValueError(f"all_to_all over {name!r} needs the process groups of {axes}")
        # equal splits: static shapes, no host sync, one collective in the compiled graph
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, self.groups.group(axes))

    def placement(self, axes: Axes) -> list:
        """Where an activation with logical ``axes`` is split over tp (or replicated)."""
        dim = self.plan.activation_tp_dims(axes)
        return [Replicate()] if dim is None else [Shard(dim)]

    def constrain(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        if self.mesh is None:
            return x
        target = self.placement(axes)
        if not isinstance(x, DTensor):  # a plain tensor here is a full value (e.g. an arange)
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return x.redistribute(self.mesh, target)

    def local(self, fn: Callable[..., Any], in_axes: tuple[Axes | None, ...], out_axes: Axes,
              partial: bool = False) -> Callable[..., Any]:
        if self.mesh is None:
            return fn
        in_placements = tuple(None if a is None else self.placement(a) for a in in_axes)
        if not partial:
            return local_map(fn, out_placements=self.placement(out_axes), in_placements=in_placements,
                             device_mesh=self.mesh)
        # each rank's result and the gradients of the inputs it read whole are partial sums
        in_grads = tuple(None if p is None else [Partial()] if p == [Replicate()] else p for p in in_placements)
        return local_map(fn, out_placements=[Partial()], in_placements=in_placements, in_grad_placements=in_grads,
                         device_mesh=self.mesh)

    def wrap(self, local: torch.Tensor, axes: Axes | None) -> torch.Tensor:
        """A local tensor (received, or read from the batch) as the DTensor it is: split as
        ``axes`` says, or replicated (``None``: every tp rank holds the same values)."""
        if self.mesh is None:
            return local
        placement = [Replicate()] if axes is None else self.placement(axes)
        return DTensor.from_local(local, self.mesh, placement, run_check=False)

    def unwrap(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        """The inverse of ``wrap``: ``x`` held as ``axes`` says, as this rank's local tensor
        (what a pipeline stage sends on)."""
        return x if self.mesh is None else self.constrain(x, axes).to_local()

    def wrap_param(self, local: torch.Tensor, lay: ParamLayout) -> torch.Tensor:
        """A parameter's local shard as a DTensor over tp, split along its tp dim."""
        if self.mesh is None:
            return local
        placement = [Shard(lay.tp_dim)] if lay.tp_dim is not None else [Replicate()]
        return DTensor.from_local(local, self.mesh, placement, run_check=False)

    def to_replicated_local(self, x: torch.Tensor) -> torch.Tensor:
        """A result that may still be a partial sum over tp (a vocab-parallel loss), summed
        over tp and as a plain tensor."""
        return x.redistribute(self.mesh, [Replicate()]).to_local() if isinstance(x, DTensor) else x
