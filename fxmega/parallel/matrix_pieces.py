"""Whole matrices for an optimizer that needs them (Muon), on a mesh that slices them.

The scheme is **gather per matrix**: each rank all-gathers the slices of every hidden matrix
it holds a part of (the optimizer view: tp's slice, then ZeRO's or fsdp's), over the groups
that cut it, in the reverse order of the cuts (``ParamShards.cuts``: tp, then the data
axes); every rank of those groups then orthogonalises the same whole matrix and keeps its
own slice of the result. It costs one all-gather of the update's direction per matrix and
step (fp32; the size of ZeRO-1's all-gather of the updated parameters) and repeats the
Newton-Schulz work on each rank of the group. Megatron's layer-wise distributed optimizer
instead gives each whole matrix to one owner rank, round-robin, and sends the result back:
n/2 times less traffic and n times less compute on n ranks, at the price of a schedule of
point-to-point exchanges; ``fxmega.planning.traffic`` counts this scheme's bytes against
that minimum.

Cuts along a matrix's batch dims (ep's experts; the q/k/v of a fused projection) need no
gather: each matrix is whole on its rank already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.optim.optimizer import ParamRole
from fxmega.parallel import collectives
from fxmega.parallel.groups import ProcessGroups
from fxmega.parallel.param_shards import ParamShards


@dataclass(frozen=True)
class Cut:
    """One split of a tensor: along ``dim`` into ``pieces``, this rank keeping piece ``which``,
    the pieces held by the ranks of ``group`` (in group order)."""

    dim: int
    pieces: int
    which: int
    group: collectives.Group


@dataclass(frozen=True)
class GatheredMatrix:
    """A hidden matrix's optimizer view on this rank as the ``cuts`` made it (``MatrixPieces``)."""

    cuts: tuple[Cut, ...]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        for cut in reversed(self.cuts):
            part = collectives.all_gather([part], [cut.dim], cut.pieces, cut.group)[0]
        return part

    def narrow(self, whole: torch.Tensor) -> torch.Tensor:
        for cut in self.cuts:
            whole = whole.chunk(cut.pieces, cut.dim)[cut.which]
        return whole


def with_pieces(roles: list[ParamRole], shards: ParamShards, groups: ProcessGroups) -> list[ParamRole]:
    """``roles`` (this rank's parameters, in leaf order) with the pieces of each hidden
    matrix whose optimizer view the layout cuts along a row or column dim."""
    out = []
    for role, lay in zip(roles, shards.layouts):
        if role.matrix is None:
            out.append(role)
            continue
        cuts = tuple(Cut(dim, pieces, which, groups.group(axes))
                     for dim, pieces, which, axes in shards.cuts_over(lay, "opt")
                     if pieces > 1 and dim not in role.matrix.batch)
        out.append(ParamRole(role.decay, role.matrix, GatheredMatrix(cuts) if cuts else None))
    return out
