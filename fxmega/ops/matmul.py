"""The one function every weight matmul of a model family goes through, so that a precision
recipe can replace it (fp8 through torchao: the issue of its own).

``matmul(x, w, role)`` is ``x @ w`` under the active ``MatmulRecipe`` (``plain`` unless a
``with use(recipe):`` block says otherwise, entered around a traced step as
``kernels.use`` is). ``role`` says which matmul it is, so that a recipe can keep some in
high precision, as torchtitan's and Megatron's fp8 recipes do:

- ``linear``: the dense layers' projections (attention q/k/v/o, the MLPs, shared experts);
- ``expert``: routed experts' products (per expert, batched, or grouped: ``grouped_mm``);
- ``router``: the MoE router's logits (kept in at least fp32 by ``ops.routing``);
- ``head``: an output head: the projection onto the vocabulary (and its chunked loss's
  products), or a classifier's onto its classes.

Attention's score and value products are activations times activations, not weight
matmuls, and stay in SDPA / ``ops.attention_blocks``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ROLES = ("linear", "expert", "router", "head")


def plain_matmul(x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
    return torch.matmul(x, w)


def plain_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=ends)


@dataclass(frozen=True)
class MatmulRecipe:
    """How weight matmuls are computed: ``matmul(x, w, role)``, and ``grouped_mm(x, w, ends)``
    for routed experts whose rows are sorted by expert (CUDA's grouped kernel)."""

    name: str
    matmul: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor] = plain_matmul
    grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = plain_grouped_mm


PLAIN = MatmulRecipe("plain")
_active = PLAIN


def active() -> MatmulRecipe:
    return _active


@contextlib.contextmanager
def use(recipe: MatmulRecipe) -> Iterator[None]:
    """Compute the block's weight matmuls with ``recipe``."""
    global _active
    previous, _active = _active, recipe
    try:
        yield
    finally:
        _active = previous


def matmul(x: torch.Tensor, w: torch.Tensor, role: str = "linear") -> torch.Tensor:
    """``x @ w`` (``torch.matmul``'s broadcasting) under the active recipe."""
    return _active.matmul(x, w, role)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times their expert's ``w`` (``torch._grouped_mm``) under
    the active recipe."""
    return _active.grouped_mm(x, w, ends)


@dataclass(frozen=True)
class WeightUse:
    """One weight matmul's reading of a parameter: its ``role``, the parameter's full shape,
    and the 2-D ``[in, out]`` weight the matmul multiplies (the parameter's dims flattened
    in two groups, as ``ops.layers.project_to_heads`` flattens ``[embed, heads, head_dim]``)."""

    role: str
    param_shape: tuple[int, ...]
    matmul_shape: tuple[int, int]

    def local_matmul_shape(self, local_param_shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The 2-D weight a rank multiplies when it holds ``local_param_shape`` of the
        parameter (a tp slice), flattened as the full one is; None if the full matmul's
        weight is not the parameter's dims in two groups in order."""
        shape = self.param_shape
        for k in range(1, len(shape)):
            if (math.prod(shape[:k]), math.prod(shape[k:])) == self.matmul_shape:
                return math.prod(local_param_shape[:k]), math.prod(local_param_shape[k:])
        return None


def recording(params: dict[int, str], uses: dict[str, list[WeightUse]]) -> MatmulRecipe:
    """A plain recipe that also notes, in ``uses``, which parameter each weight matmul reads:
    ``params`` maps ``id`` of each parameter tensor to its path, and a matmul's weight is
    found through its views (``reshape``, ``t``) back to the parameter it was made from."""

    def recorded(x: torch.Tensor, w: torch.Tensor, role: str) -> torch.Tensor:
        base = w
        while base._base is not None:
            base = base._base
        if id(base) in params and w.dim() == 2:
            uses.setdefault(params[id(base)], []).append(
                WeightUse(role, tuple(base.shape), (w.shape[0], w.shape[1])))
        return plain_matmul(x, w, role)

    return MatmulRecipe("recording", recorded)
