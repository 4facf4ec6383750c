"""Tensor-parallel activation layouts: the ``ActivationLayout`` that model code's
``shard(x, *axes)`` and ``local(fn, ...)`` (``fxmega.sharding.layout``) resolve to on a mesh
with tp. Each logical name becomes an explicit ``redistribute`` over the 1-D tp mesh, so
Megatron's layouts are held on purpose (DTensor's own propagation picks slower ones), and
attention-like functions run per shard with ``local_map``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from fxmega.sharding.plan import ParamLayout, ShardingPlan

Axes = tuple[str | None, ...]


class TensorParallelLayouts:
    """Logical axis names -> placements on ``tp_mesh``, as ``plan``'s rules say."""

    def __init__(self, plan: ShardingPlan, tp_mesh: DeviceMesh) -> None:
        self.plan, self.tp_mesh = plan, tp_mesh

    def placement(self, axes: Axes) -> list:
        """Where an activation with logical ``axes`` is split over tp (or replicated)."""
        dim = self.plan.activation_tp_dims(axes)
        return [Replicate()] if dim is None else [Shard(dim)]

    def constrain(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        target = self.placement(axes)
        if not isinstance(x, DTensor):  # a plain tensor here is a full value (e.g. an arange)
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return x.redistribute(self.tp_mesh, target)

    def local(self, fn: Callable[..., Any], in_axes: tuple[Axes | None, ...], out_axes: Axes) -> Callable[..., Any]:
        in_placements = tuple(None if a is None else self.placement(a) for a in in_axes)
        return local_map(fn, out_placements=self.placement(out_axes), in_placements=in_placements,
                         device_mesh=self.tp_mesh)

    def wrap(self, local: torch.Tensor, axes: Axes | None) -> DTensor:
        """A local tensor (received, or read from the batch) as the DTensor it is: split as
        ``axes`` says, or replicated (``None``: every tp rank holds the same values)."""
        placement = [Replicate()] if axes is None else self.placement(axes)
        return DTensor.from_local(local, self.tp_mesh, placement, run_check=False)

    def wrap_param(self, local: torch.Tensor, lay: ParamLayout) -> DTensor:
        """A parameter's local shard as a DTensor over tp, split along its tp dim."""
        placement = [Shard(lay.tp_dim)] if lay.tp_dim is not None else [Replicate()]
        return DTensor.from_local(local, self.tp_mesh, placement, run_check=False)
