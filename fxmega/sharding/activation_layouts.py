"""Activation layouts: the ``ActivationLayouts`` that model code's ``shard(x, *axes)`` and
``local(fn, ...)`` (``fxmega.sharding.layout``) resolve to on a mesh with tensor (tp) or
context (cp) parallelism. Activations are DTensors over the sub-mesh of those two axes:

  * over tp, each logical name is split as the rules say (Megatron's column/row-parallel
    layouts, sequence parallelism with ``"seq": "tp"``), held on purpose by an explicit
    ``redistribute`` (DTensor's own propagation picks slower ones);
  * over cp, the sequence is split for the whole model by construction (not by a rule):
    the residual stream's ``seq`` and a block's ``ctx`` are split, attention's keys and
    values (named with the sequence whole) are gathered.

Attention-like functions run per shard with ``local_map``. An input the function reads
whole on a mesh axis over which its output is split gets its gradient summed over that
axis (``in_grad_placements``: ``Partial``): each rank's queries used the gathered keys and
values differently, so the gather's backward is a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from fxmega.sharding.plan import ParamLayout, ShardingPlan

Axes = tuple[str | None, ...]
# the logical names of the sequence that context parallelism splits
CONTEXT_AXES = ("seq", "ctx")
# heads split over cp as well as tp: all-to-all (Ulysses) attention's layout inside attention
CP_HEADS = {"cp_heads": "heads", "cp_kv_heads": "kv_heads"}


class ActivationLayouts:
    """Logical axis names -> placements on ``mesh`` (its dims: ``cp`` and/or ``tp``)."""

    def __init__(self, plan: ShardingPlan, mesh: DeviceMesh, cp_attention: str = "allgather") -> None:
        self.plan, self.mesh = plan, mesh
        self.axes: tuple[str, ...] = tuple(mesh.mesh_dim_names)
        self.cp_attention = cp_attention if "cp" in self.axes else None  # what ``layers`` asks for

    def _dim(self, axes: Axes, mesh_axis: str) -> int | None:
        if mesh_axis == "tp":
            return self.plan.activation_tp_dims(tuple(CP_HEADS.get(a, a) if a else a for a in axes))
        dims = [i for i, name in enumerate(axes) if name in CONTEXT_AXES or name in CP_HEADS]
        return dims[0] if dims else None

    def placement(self, axes: Axes) -> list:
        """Where an activation with logical ``axes`` is split on each mesh dim (or replicated)."""
        out = []
        for mesh_axis in self.axes:  # a loop, not a comprehension with :=, which dynamo does not trace
            dim = self._dim(axes, mesh_axis)
            out.append(Replicate() if dim is None else Shard(dim))
        return out

    def replicated(self) -> list:
        return [Replicate()] * len(self.axes)

    def constrain(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        target = self.placement(axes)
        if not isinstance(x, DTensor):  # a plain tensor here is a full value (e.g. an arange)
            x = DTensor.from_local(x, self.mesh, self.replicated(), run_check=False)
        return x.redistribute(self.mesh, target)

    def local(self, fn: Callable[..., Any], in_axes: tuple[Axes | None, ...], out_axes: Axes) -> Callable[..., Any]:
        out = self.placement(out_axes)
        in_placements = tuple(None if a is None else self.placement(a) for a in in_axes)
        grads = tuple(None if p is None else [Partial() if isinstance(mine, Replicate) and isinstance(o, Shard)
                                              else mine for mine, o in zip(p, out)]
                      for p in in_placements)
        # redistribute_inputs: keys and values split along the sequence over cp are gathered
        return local_map(fn, out_placements=out, in_placements=in_placements, in_grad_placements=grads,
                         device_mesh=self.mesh, redistribute_inputs=True)

    def wrap(self, local: torch.Tensor, axes: Axes | None) -> DTensor:
        """A local tensor (received, or read from the batch) as the DTensor it is: split as
        ``axes`` says, or replicated (``None``: every rank of the mesh holds the same values)."""
        placement = self.replicated() if axes is None else self.placement(axes)
        return DTensor.from_local(local, self.mesh, placement, run_check=False)

    def wrap_param(self, local: torch.Tensor, lay: ParamLayout) -> DTensor:
        """A parameter's local shard as a DTensor: split along its tp dim, replicated over cp
        (so its gradient, a partial sum over cp's chunks, is summed by the backward)."""
        return DTensor.from_local(local, self.mesh, [Shard(lay.tp_dim) if a == "tp" and lay.tp_dim is not None
                                                     else Replicate() for a in self.axes], run_check=False)

    def to_replicated_local(self, x: torch.Tensor) -> torch.Tensor:
        """A result that may still be a partial sum (a loss over tp's vocabulary or cp's chunks),
        summed and as a plain tensor."""
        return x.redistribute(self.mesh, self.replicated()).to_local() if isinstance(x, DTensor) else x
