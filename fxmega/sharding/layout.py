"""Activation layouts: how model code says which logical axes an activation has.

Model code calls ``shard(x, "batch", "seq", "embed")`` at block boundaries and runs
per-shard kernels (attention) through ``local(fn, ...)``; an exchange between the ranks that
split a logical axis (experts' tokens) is ``all_to_all(x, name)``. With no sharding plan active both
are the identity, so the model runs unchanged on one device; under a plan
(``activate(layout)``, held for the duration of a traced step) ``shard`` becomes an
explicit ``redistribute`` to the placements the rules give those names and ``local`` runs
``fn`` on each rank's shards through ``local_map``.

This module is the one place the active plan lives, so that model files stay free of
meshes and process groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class ContextParallelism(Protocol):
    """What attention needs of context parallelism (``fxmega.parallel.context.ContextParallel``):
    the other ranks' chunks, gathered or exchanged for head groups."""

    mode: str

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor: ...

    def to_heads(self, x: torch.Tensor) -> torch.Tensor: ...

    def from_heads(self, x: torch.Tensor) -> torch.Tensor: ...

    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class ActivationLayout(Protocol):
    """What a sharding plan provides to model code (implemented in ``fxmega.parallel``)."""

    context: ContextParallelism | None  # cp's collectives for attention; None without cp

    def constrain(self, x: Any, axes: tuple[str | None, ...]) -> Any: ...

    def local(self, fn: Callable[..., Any], in_axes: tuple[tuple[str | None, ...] | None, ...],
              out_axes: tuple[str | None, ...], partial: bool = False) -> Callable[..., Any]: ...

    def axis_size(self, name: str) -> int: ...

    def all_to_all(self, x: torch.Tensor, name: str) -> torch.Tensor: ...


_active: ActivationLayout | None = None


@contextlib.contextmanager
def activate(layout: ActivationLayout | None) -> Iterator[None]:
    """Make ``layout`` the one that ``shard``/``local`` use inside this block."""
    global _active
    previous, _active = _active, layout
    try:
        yield
    finally:
        _active = previous


def active() -> ActivationLayout | None:
    return _active


def context_parallelism() -> ContextParallelism | None:
    """The active plan's context parallelism, which attention reaches across chunks with
    (None: no plan, or no cp axis)."""
    return None if _active is None else _active.context


def shard(x: torch.Tensor, *axes: str | None) -> torch.Tensor:
    """Constrain activation ``x`` (one logical name per dim) to the active plan's layout."""
    if _active is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"shard() got {len(axes)} axis names {axes} for a {x.ndim}-dim tensor")
    return _active.constrain(x, axes)


def local(fn: Callable[..., Any], in_axes: tuple[tuple[str | None, ...] | None, ...],
          out_axes: tuple[str | None, ...], partial: bool = False) -> Callable[..., Any]:
    """``fn`` run on each rank's local shards (like ``jax.shard_map`` with logical names).

    ``in_axes`` names the dims of each tensor argument (``None`` for non-tensor arguments)
    and ``out_axes`` those of the single tensor result. ``fn`` must be correct on any shard
    of those axes: e.g. attention is, when batch and heads are split but seq is whole.

    ``partial``: ``fn`` contracts over a split dim (a row-parallel product, experts split
    along their hidden width), so each rank's result is a partial sum, which the next
    ``shard`` reduces; the gradients of the inputs it reads whole are partial sums too.
    """
    if _active is None:
        return fn
    return _active.local(fn, in_axes, out_axes, partial)


def axis_size(name: str) -> int:
    """How many ranks split logical axis ``name`` under the active plan (1: none, or no plan):
    e.g. over how many ranks a MoE layer's experts are spread."""
    return 1 if _active is None else _active.axis_size(name)


def all_to_all(x: torch.Tensor, name: str) -> torch.Tensor:
    """Among the ``axis_size(name)`` ranks that split logical axis ``name``: ``x``'s first dim
    cut in that many equal chunks, chunk ``j`` sent to the ``j``-th of them, the chunks
    received stacked along the first dim in the same order (``jax.lax.all_to_all`` with
    split and concat axis 0). Differentiable (the backward is the reverse exchange); the
    identity when nothing splits ``name``. Called on local tensors (inside ``local``)."""
    return x if _active is None else _active.all_to_all(x, name)
