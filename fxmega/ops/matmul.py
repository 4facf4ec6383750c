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
