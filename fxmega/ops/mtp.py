"""Multi-token prediction (DeepSeek-V3 report, section 2.2): what depth ``k`` predicts and
reads, and how its loss is weighed and reported. The modules themselves are the family's.

At position ``i`` the main model predicts token ``t[i+1]`` (``targets[i]``). MTP module ``k``
combines the previous depth's hidden state at ``i`` with the embedding of ``t[i+k]``
(``targets[i+k-1]``) and predicts ``t[i+k+1]`` (``targets[i+k]``). Shifting the targets
left keeps every depth at the sequence's length, as Megatron-Core does (``roll_tensor``): the
last ``k`` positions of depth ``k`` have no target and are out of its loss, and causal
attention keeps what was shifted in there from every other position.

The loss: ``weight / D`` times the sum of each depth's summed cross-entropy, added to the
main loss's sum, so the step divides both by the main loss's token count. A depth-``k``
sequence of ``T`` targets has ``T - k`` of its own, so its term is ``(T - k) / T`` of its
per-target mean: Megatron-Core's ``calculate_per_token_loss`` weighs MTP the same way, and
it keeps the loss independent of how the batch is split. Each depth's per-target mean is
reported (``report``) from its summed loss and target count, which the layers hand to the
step's meter (``fxmega.ops.aux_loss.measure``) under ``stat_names``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def stat_names(depth: int) -> tuple[str, ...]:
    """What the MTP modules of a model with ``depth`` of them hand the meter: per depth, its
    summed cross-entropy and its number of targets."""
    return tuple(name for k in range(1, depth + 1) for name in (f"mtp{k}_loss_sum", f"mtp{k}_targets"))


def shift(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t [batch, seq, ...]`` moved ``k`` positions left along the sequence: position ``i``
    holds what ``i + k`` held; the last ``k`` hold what wrapped around (never a counted
    target: ``depth_mask`` zeroes them). Slices and a concatenation rather than
    ``torch.roll``: a batch tensor replicated over tp stays a DTensor through them."""
    return t if k == 0 else torch.cat([t[:, k:], t[:, :k]], dim=1)


def depth_mask(targets: torch.Tensor, loss_mask: torch.Tensor | None, k: int) -> torch.Tensor:
    """Which positions count in depth ``k``'s loss ``[batch, seq]`` (fp32 0/1 weights): the
    loss mask (every target without one) shifted ``k`` left, zero on the last ``k``
    positions, which have no target."""
    mask = torch.ones_like(targets, dtype=torch.float32) if loss_mask is None else loss_mask.to(torch.float32)
    return torch.cat([mask[:, k:], torch.zeros_like(mask[:, :k])], dim=1)


def report(stats: Mapping[str, float]) -> dict[str, float]:
    """Each depth's per-target cross-entropy (``mtp_loss_<k>``) from the meter's summed
    ``stat_names`` values."""
    out = {}
    k = 1
    while f"mtp{k}_loss_sum" in stats:
        n = stats[f"mtp{k}_targets"]
        out[f"mtp_loss_{k}"] = stats[f"mtp{k}_loss_sum"] / n if n else float("nan")
        k += 1
    return out
