"""What every optimizer's step shares, over lists of tensors: which parameters are decayed,
per-tensor and global gradient norms, clipping by the global norm, and the sign update of
the MoE expert biases. The optimizers themselves are in ``fxmega.optim``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxmega.core import tree
from fxmega.core.spec import ParamSpec
from fxmega.optim.matrices import matrix_view
from fxmega.optim.optimizer import ParamRole


def decay_mask(specs: tree.Tree, decay_embeddings: bool = False) -> list[bool]:
    """Which parameters get weight decay, in leaf order: matrices yes; norms and biases
    (1-dim) no; embedding tables (first dim ``vocab`` or ``position``) only if asked.
    An untied output head (``[embed, vocab]``) is a matrix like any other and is decayed."""

    def decays(spec: ParamSpec) -> bool:
        if len(spec.shape) < 2:
            return False
        return decay_embeddings or spec.axes[0] not in ("vocab", "position")

    return [decays(s) for s in tree.leaves(specs)]


def param_roles(specs: tree.Tree, decay_embeddings: bool = False) -> list[ParamRole]:
    """Each parameter's role for the optimizer, in leaf order: its weight decay
    (``decay_mask``) and its view as hidden matrices (``fxmega.optim.matrices``)."""
    return [ParamRole(decay, matrix_view(spec))
            for decay, spec in zip(decay_mask(specs, decay_embeddings), tree.leaves(specs))]


def per_tensor_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each gradient, in fp32 (a non-finite entry names a bad gradient)."""
    return torch.stack(torch._foreach_norm([g.float() for g in grads]))


def global_norm(grads: list[torch.Tensor], weights: torch.Tensor | None = None,
                sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                norms: torch.Tensor | None = None) -> torch.Tensor:
    """L2 norm of all gradients taken together, in fp32.

    For sharded gradients, ``weights`` (one 0/1 per tensor) keeps each element counted on
    exactly one rank and ``sum_over_ranks`` adds the squared norms of all ranks."""
    norms = per_tensor_norms(grads) if norms is None else norms
    squares = norms * norms
    if weights is not None:
        squares = squares * weights
    total = squares.sum()
    if sum_over_ranks is not None:
        total = sum_over_ranks(total)
    return total.sqrt()


def clip_by_global_norm_(grads: list[torch.Tensor], max_norm: float, weights: torch.Tensor | None = None,
                         sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         norms: torch.Tensor | None = None) -> torch.Tensor:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (0: no clipping).
    Returns the norm before clipping. No data-dependent branch, so it compiles whole."""
    norm = global_norm(grads, weights, sum_over_ranks, norms)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


def sign_update_(params: list[torch.Tensor], loads: list[torch.Tensor], rates: list[float],
                 apply: torch.Tensor) -> None:
    """Move each parameter by ``rate x sign(mean(load) - load)`` where ``apply`` is 1: up
    where its load is below the mean, down where above (DeepSeek-V3's expert-bias update;
    a positive scale of ``load`` changes nothing, so clipping and loss scaling do not matter)."""
    for p, load, rate in zip(params, loads, rates):
        p.add_(torch.sign(load.mean() - load) * (rate * apply))
