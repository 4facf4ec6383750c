"""Parameters on a mesh: this rank's slice of every tensor, the padding tp needs, the seeded
init that equals the slice of the one-device init, and the way back to full tensors.

Leaf order everywhere is the spec tree's leaf order; ``layouts[i]`` describes leaf ``i``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fxmega.core import tree
from fxmega.core.spec import ParamSpec
from fxmega.ops.init import init_slice
from fxmega.parallel.groups import ProcessGroups
from fxmega.sharding.plan import ParamLayout, ShardingPlan


class ParamShards:
    """The parameters ``specs`` (this rank's part of the model: its pipeline stages') as
    ``plan`` splits them over ``groups``' mesh."""

    def __init__(self, plan: ShardingPlan, groups: ProcessGroups, specs: tree.Tree) -> None:
        self.plan, self.groups, self.specs = plan, groups, specs
        self.layout_tree = tree.map_with_path(lambda path, _: plan.params[path], specs)
        self.layouts: list[ParamLayout] = tree.leaves(self.layout_tree)

    def cuts(self, lay: ParamLayout, kind: str = "param") -> list[tuple[int, int, int]]:
        """How this rank's slice is cut from the full (padded) tensor: ``(dim, pieces,
        which)`` in order — tp, then ep, then the data axes (ZeRO / fsdp)."""
        return [(dim, pieces, which) for dim, pieces, which, _ in self.cuts_over(lay, kind)]

    def cuts_over(self, lay: ParamLayout, kind: str = "param") -> list[tuple[int, int, int, tuple[str, ...]]]:
        """``cuts`` with the mesh axes each one is made over."""
        coords, out = self.groups.coords, []
        if lay.tp_dim is not None:
            out.append((lay.tp_dim, self.groups.tp, coords["tp"], ("tp",)))
        if lay.ep_dim is not None:
            out.append((lay.ep_dim, lay.ep_size, coords["ep"], ("ep",)))
        split = lay.data_split(kind)
        if lay.zero_dim is not None and split > 1:
            out.append((lay.zero_dim, split, lay.data_index(kind, coords), tuple(lay.data_axes[kind])))
        return out

    def shard(self, full: torch.Tensor, lay: ParamLayout, kind: str = "param") -> torch.Tensor:
        """This rank's slice of a full (padded) tensor, for ``kind`` param/grad/opt."""
        t = full
        for dim, pieces, which in self.cuts(lay, kind):
            t = t.chunk(pieces, dim)[which]
        return t.contiguous()

    def local_index(self, path: str) -> list[torch.Tensor]:
        """Per dim, the positions in the unpadded parameter at ``path`` that this rank's
        shard holds (-1: tp's padding): what ``shard(pad(full))`` keeps, without the full."""
        lay, shape = self.plan.params[path], tree.get(self.specs, path).shape
        index = [torch.where(torch.arange(n) < have, torch.arange(n), -1) for n, have in zip(lay.shape, shape)]
        for dim, pieces, which in self.cuts(lay):
            index[dim] = index[dim].chunk(pieces)[which]
        return index

    @staticmethod
    def pad(full: torch.Tensor, lay: ParamLayout) -> torch.Tensor:
        """Zero rows (or columns) appended to vocabulary dims that tp does not divide."""
        if tuple(full.shape) == lay.shape:
            return full
        pads: list[int] = []
        for have, want in reversed(list(zip(full.shape, lay.shape))):
            pads += [0, want - have]
        return torch.nn.functional.pad(full, pads)

    def local_of(self, full: torch.Tensor, path: str) -> torch.Tensor:
        """This rank's shard of the full, unpadded parameter at ``path``."""
        lay = self.plan.params[path]
        return self.shard(self.pad(full, lay), lay)

    def init_params(self, seed: int, device: torch.device) -> tree.Tree:
        """Local shards of every parameter, drawn on ``device`` and only there, equal to the
        slice of the single-device init."""
        def one(path: str, spec: ParamSpec) -> torch.Tensor:
            return init_slice(spec, path, seed, self.local_index(path), device).requires_grad_(True)

        return tree.map_with_path(one, self.specs)

    def placements(self, lay: ParamLayout, kind: str) -> list:
        out = []
        for axis in self.groups.mesh.names:
            if axis == "tp" and lay.tp_dim is not None:
                out.append(Shard(lay.tp_dim))
            elif axis == "ep" and lay.ep_dim is not None:
                out.append(Shard(lay.ep_dim))
            elif axis in lay.data_axes[kind]:
                out.append(Shard(lay.zero_dim))
            else:
                out.append(Replicate())
        return out

    def as_dtensor(self, local: torch.Tensor, lay: ParamLayout, kind: str = "param") -> DTensor:
        """A local shard as a DTensor over the whole mesh (for checkpoints and inspection)."""
        return DTensor.from_local(local, self.groups.device_mesh, self.placements(lay, kind), run_check=False,
                                  shape=torch.Size(lay.shape), stride=_contiguous_stride(lay.shape))

    def full_tensors(self, flat: list[torch.Tensor], kind: str = "param") -> list[torch.Tensor]:
        """Every parameter gathered to its full (padded) value on every rank (eager)."""
        return [self.as_dtensor(t.detach(), lay, kind).full_tensor() for t, lay in zip(flat, self.layouts)]

    def full_params(self, params: tree.Tree, full_specs: tree.Tree, kind: str = "param") -> tree.Tree:
        """The whole model (``full_specs``' tree) as full (padded) tensors on every rank, from
        this rank's shards ``params`` (every rank takes part); ``kind="opt"`` gathers a tree
        laid out as the optimizer state is (ZeRO shards it further). Pipeline stages are
        exchanged with an all_gather_object over pp: for checking small models, not for 70B."""
        flat = self.full_tensors(tree.leaves(params), kind)
        if self.plan.pipeline is None:
            return tree.unflatten_like(full_specs, flat)
        device = flat[0].device if flat else torch.device("cpu")
        mine = {p: t.cpu() for p, t in zip(tree.paths(self.specs), flat)}
        everyone: list[dict] = [{} for _ in range(self.groups.mesh.size("pp"))]
        dist.all_gather_object(everyone, mine, group=self.groups.group(("pp",)).get_group())
        merged = {p: t for part in everyone for p, t in part.items()}
        return tree.map_with_path(lambda path, _: merged[path].to(device), full_specs)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
