"""Mixture-of-experts routing: which experts each token goes to, with what weight, and the
terms that keep the experts' load balanced.

``route`` is the router of Mixtral, Qwen-MoE and DeepSeek-V3 in one function: scores over the
experts by softmax or sigmoid, optional group-limited selection (DeepSeek-V3: only the
``topk_groups`` best groups of experts are eligible), an optional per-expert bias that takes
part in the selection only (DeepSeek-V3's auxiliary-loss-free balancing), the top ``k``,
their weights optionally normalised to sum to 1, and a final scale.

The balancing terms are computed per sequence (DeepSeek-V3's sequence-wise auxiliary loss;
Megatron-LM's ``seq_aux_loss``), so a sequence's term does not depend on which other
sequences share its micro batch or data rank: a run equals itself on any mesh and any split
into micro batches. Each term honours the attention mask: padding is routed but not counted.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from fxmega.ops.matmul import matmul

SCORES = ("softmax", "sigmoid")


class RouterSettings(Protocol):
    """The router's part of a model's MoE settings (``fxmega.ops.moe.MoE``)."""

    n_experts: int
    top_k: int
    score: str  # softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
    norm_topk: bool  # the k weights sum to 1
    n_groups: int  # group-limited routing: experts in n_groups groups ...
    topk_groups: int  # ... of which the best topk_groups are eligible for each token
    route_scale: float  # the routed output's factor (DeepSeek-V3: 2.5)


class Routing(NamedTuple):
    """What the router decided for ``T`` tokens: ``experts [T, k]`` (int64), ``weights
    [T, k]`` (fp32 or wider: what each chosen expert's output is multiplied by), ``probs [T, E]``
    (fp32 scores, for the balancing loss) and ``logits [T, E]`` (fp32, for the z-loss)."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


def route(x: torch.Tensor, w_router: torch.Tensor, router: RouterSettings, bias: torch.Tensor | None = None) -> Routing:
    """Route tokens ``x [T, d]`` through ``w_router [d, E]``; ``bias [E]`` (when the router
    has ``expert_bias``) shifts the selection, never the weights."""
    # at least fp32: the choice of experts should not hinge on bf16 rounding
    dtype = torch.promote_types(x.dtype, torch.float32)
    logits = matmul(x.to(dtype), w_router.to(dtype), "router")
    probs = logits.softmax(-1) if router.score == "softmax" else logits.sigmoid()
    choice = probs if bias is None else probs + bias.to(dtype)
    if router.n_groups > 1:
        choice = _best_groups_only(choice, router)
    experts = choice.topk(router.top_k, dim=-1).indices
    weights = probs.gather(-1, experts)
    if router.norm_topk and router.top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    return Routing(experts, weights * router.route_scale, probs, logits)


def _best_groups_only(choice: torch.Tensor, router: RouterSettings) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_groups`` best groups set to
    -inf. A group's score is the sum of its two best experts' (DeepSeek-V3), or its best
    with a group of one expert."""
    t, e = choice.shape
    grouped = choice.view(t, router.n_groups, e // router.n_groups)
    group_score = grouped.topk(min(2, e // router.n_groups), dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score).scatter(-1, group_score.topk(router.topk_groups, dim=-1).indices, 1.0)
    return grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(t, e)


def expert_counts(experts: torch.Tensor, n_experts: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the tokens (rows of ``experts [..., T, k]``) each expert received,
    ``[..., E]`` in fp32; rows where ``valid [..., T]`` is 0 are not counted."""
    # new_zeros / ones_like: DTensors stay DTensors (routing runs on tp-replicated activations)
    one_hot = experts.new_zeros((*experts.shape[:-1], n_experts), dtype=torch.float32)
    one_hot = one_hot.scatter_add(-1, experts, torch.ones_like(experts, dtype=torch.float32))
    if valid is not None:
        one_hot = one_hot * valid.unsqueeze(-1).float()
    return one_hot.sum(-2)


def balancing_loss(routing: Routing, batch: int, router: RouterSettings,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """The switch/GShard load-balancing loss of each of ``batch`` sequences, ``[batch]`` (not
    yet times a coefficient): per sequence of ``T`` counted tokens,
    ``E / (k T^2) * sum_e count_e * prob_sum_e``, which is 1 for a perfectly balanced router
    and grows as load and probability concentrate on the same experts (Megatron-LM's
    normalisation). Sigmoid scores are normalised per token first, as DeepSeek-V3 does."""
    e, k = router.n_experts, router.top_k
    probs = routing.probs.view(batch, -1, e)
    if router.score == "sigmoid":
        probs = probs / probs.sum(-1, keepdim=True)
    counts = expert_counts(routing.experts.view(batch, -1, k), e, valid)
    if valid is not None:
        probs = probs * valid.unsqueeze(-1).float()
    tokens = sequence_tokens(probs.shape[1], batch, valid, probs)
    return (counts * probs.sum(1)).sum(-1) * e / (k * tokens.clamp(min=1) ** 2)


def z_loss(routing: Routing, batch: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The router z-loss (ST-MoE, Zoph et al. 2022) of each of ``batch`` sequences, ``[batch]``
    (not yet times a coefficient): the mean over a sequence's counted tokens of
    ``logsumexp(logits)^2``, which keeps the router's logits small."""
    z = torch.logsumexp(routing.logits, dim=-1).square().view(batch, -1)
    if valid is not None:
        z = z * valid.float()
    return z.sum(-1) / sequence_tokens(z.shape[1], batch, valid, z).clamp(min=1)


def sequence_tokens(length: int, batch: int, valid: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The counted tokens of each sequence, ``[batch]`` in ``like``'s dtype: those ``valid``
    marks, else all (``like`` keeps a DTensor a DTensor)."""
    if valid is None:
        return like.new_full((batch,), float(length))
    return valid.to(like.dtype).sum(-1)
