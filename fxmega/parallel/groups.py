"""This rank's place on the mesh and the process groups over its axes.

Groups are 1-D device meshes (several axes are flattened into one), made on first use and
kept: a group must exist before a compiled step runs, since flattening a mesh does not
trace (and making one inside a recomputed region is a side effect dynamo refuses). The data
axes', the token axes' and ep's groups are made up front for that reason.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from fxmega.sharding.mesh import DATA_AXES, PHYSICAL_ORDER, MeshSpec


class ProcessGroups:
    """The mesh (``mesh``: sizes by axis name; ``device_mesh``: torch's), this rank's
    coordinates on it, and the groups over any set of its axes."""

    def __init__(self, mesh: MeshSpec, device_mesh: DeviceMesh, rank: int) -> None:
        self.mesh, self.device_mesh, self.rank = mesh, device_mesh, rank
        self.coords = mesh.coords(rank)
        self.tp, self.cp = mesh.size("tp"), mesh.size("cp")
        self.tp_mesh: DeviceMesh | None = device_mesh["tp"] if self.tp > 1 else None
        self.cp_mesh: DeviceMesh | None = device_mesh["cp"] if self.cp > 1 else None
        self.data_axes = tuple(a for a in DATA_AXES if mesh.size(a) > 1)
        # the axes over which ranks hold different tokens: a loss is summed over them
        self.token_axes = self.data_axes + (("cp",) if self.cp > 1 else ())
        self._groups: dict[tuple[str, ...], DeviceMesh] = {}
        self._pipeline_subgroups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        if self.data_axes:
            self.group(self.data_axes)
        if self.token_axes:
            self.group(self.token_axes)
        if mesh.size("ep") > 1:  # the experts' all-to-all, traced inside recomputed regions too
            self.group(("ep",))

    def group(self, axes: tuple[str, ...]) -> DeviceMesh:
        """The process group (as a 1-D mesh) spanning ``axes``."""
        axes = tuple(a for a in PHYSICAL_ORDER if a in axes)
        if axes not in self._groups:
            sub = self.device_mesh[axes[0]] if len(axes) == 1 else self.device_mesh[axes]._flatten("_".join(axes))
            self._groups[axes] = sub
        return self._groups[axes]

    def pipeline_subgroup(self, pp_ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of the pp ranks ``pp_ranks`` of this rank's pipeline (every
        other coordinate the same): Megatron's embedding group when they are the first and
        the last stage's. None where this rank's pp rank is not among them. A collective
        call: every rank makes every pipeline's group, so every rank calls it, in one order."""
        if pp_ranks not in self._pipeline_subgroups:
            ranks = self.device_mesh.mesh
            pp_dim = self.device_mesh.mesh_dim_names.index("pp")
            pipelines = ranks.movedim(pp_dim, -1).reshape(-1, ranks.shape[pp_dim]).tolist()
            mine, _ = dist.new_subgroups_by_enumeration([[line[r] for r in pp_ranks] for line in pipelines])
            self._pipeline_subgroups[pp_ranks] = mine
        return self._pipeline_subgroups[pp_ranks]

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod([self.mesh.size(a) for a in axes])

    def labels(self) -> dict[str, str]:
        """Process-group name -> the mesh axes it spans (for reading recorded collectives)."""
        labels = {dist.group.WORLD.group_name: "world"}
        for axes, sub in self._groups.items():
            labels[sub.get_group().group_name] = "+".join(axes)
        if self.tp_mesh is not None:
            labels[self.tp_mesh.get_group().group_name] = "tp"
        if self.cp_mesh is not None:
            labels[self.cp_mesh.get_group().group_name] = "cp"
        for pp_ranks, group in self._pipeline_subgroups.items():
            if group is not None:
                labels[group.group_name] = "pp" + ",".join(map(str, pp_ranks))
        return labels

    @property
    def data_rank(self) -> int:
        return self.mesh.data_rank(self.rank)

    @property
    def data_size(self) -> int:
        return self.mesh.data_size

    def sum_over_world(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    def sum_over_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's tokens (a loss, a count) summed over every rank that holds
        other tokens: the data ranks, and the cp ranks' chunks."""
        if not self.token_axes:
            return x
        return funcol.all_reduce(x, "sum", self.group(self.token_axes))
