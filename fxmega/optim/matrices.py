"""Which parameters are hidden weight matrices, and how each is seen as a stack of matrices:
what an optimizer that acts on whole matrices (Muon's orthogonalisation) needs to know,
read from the logical axes every ``ParamSpec`` already carries.

A hidden matrix reads or writes the model width (an ``embed`` axis) and is not a table
looked up by ids (``vocab``, ``position``, ``token_type``): the attention projections, the
MLP, the experts, the router, the pooler. Embeddings, the output head (it has a ``vocab``
axis), norms, biases and T5's relative-position table are not.

Its dims split three ways:

- **batch** dims, each index its own matrix: ``expert`` (each expert is its own MLP) and
  ``qkv`` (a fused projection is three linear maps, Q, K and V, concatenated for speed;
  orthogonalised whole, their update would mix their scales, so they are split per
  projection, as Megatron-Core's Muon does by default);
- the **rows** and **columns**: the model width on one side, every other dim (``heads`` x
  ``head_dim``, ``mlp``) on the other, whichever side the spec puts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxmega.core.spec import ParamSpec

WIDTH_AXES = ("embed",)  # the residual stream's width: a matrix maps to or from it
TABLE_AXES = ("vocab", "position", "token_type")  # rows looked up by ids, not multiplied
BATCH_AXES = ("expert", "qkv")  # one matrix per index


@dataclass(frozen=True)
class MatrixView:
    """The dims of a parameter that index separate matrices (``batch``), and those that form
    each matrix's rows and columns, in the parameter's dim order."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(matrices, rows, columns) of a parameter shaped ``shape``."""
        # lists, not generators: this runs inside the compiled step, where dynamo traces it
        return math.prod([shape[d] for d in self.batch]), math.prod([shape[d] for d in self.rows]), \
            math.prod([shape[d] for d in self.cols])

    def to_matrices(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a ``[matrices, rows, columns]`` tensor."""
        return t.permute(*self.batch, *self.rows, *self.cols).reshape(self.shape(tuple(t.shape)))

    def from_matrices(self, m: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The inverse of ``to_matrices`` for a parameter shaped ``shape``."""
        order = (*self.batch, *self.rows, *self.cols)
        return m.reshape([shape[d] for d in order]).permute(*[order.index(d) for d in range(len(shape))])


def matrix_view(spec: ParamSpec) -> MatrixView | None:
    """How ``spec`` is a stack of hidden matrices, or None where it is not one."""
    axes = spec.axes
    if spec.sign_rate or not any(a in WIDTH_AXES for a in axes) or any(a in TABLE_AXES for a in axes):
        return None
    batch = tuple(d for d, a in enumerate(axes) if a in BATCH_AXES)
    rest = [d for d in range(len(axes)) if d not in batch]
    if len(rest) < 2:
        return None
    width = [d for d in rest if axes[d] in WIDTH_AXES]
    if width[0] == rest[0]:  # [embed, ...]: the width is the rows
        return MatrixView(batch, (rest[0],), tuple(rest[1:]))
    return MatrixView(batch, tuple(rest[:-1]), (rest[-1],))
