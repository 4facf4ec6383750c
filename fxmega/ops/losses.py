"""Cross-entropy over the vocabulary a chunk of tokens at a time.

For a 50k-vocabulary model the fp32 logits of a whole micro batch are often the largest
tensor of the step (8 x 1024 tokens x 50,257 x 4 bytes = 1.6 GiB), and the plain loss keeps
them, or their softmax, for the backward. ``chunked_cross_entropy_sum`` runs the output
projection and the loss on ``chunk`` tokens at a time and computes the gradients of each
chunk right away (the loss is the last op of the step, so they are known in the forward):
what it keeps for the backward is the gradient of the hidden states and of the output
weight, never logits. Liger-Kernel's fused linear cross-entropy works the same way.

The per-row loss and its gradient with respect to the logits come from
``cross_entropy_rows``: PyTorch ops here, a Triton kernel with ``compute.kernels=triton``
(see ``fxmega.ops.kernels``).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch.distributed.tensor import DTensor

from fxmega.core.errors import ConfigError
from fxmega.ops import kernels
from fxmega.ops.matmul import matmul
from fxmega.ops.phases import backward_phase


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor,
                       vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits [N, V]``: the loss ``logsumexp - logit[target]`` (fp32) and its
    gradient ``softmax - onehot(target)`` (in ``logits.dtype``), with the columns from
    ``vocab_size`` on (tensor-parallel padding) out of the softmax."""
    x = logits.float()
    if vocab_size < x.shape[-1]:
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= vocab_size, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    loss = lse - x.gather(-1, targets[:, None]).squeeze(-1)
    grad = torch.exp(x - lse[:, None])
    grad = grad - torch.nn.functional.one_hot(targets, x.shape[-1]).to(grad.dtype)
    return loss, grad.to(logits.dtype)


def _rows_fn() -> Any:
    return kernels.cross_entropy_rows if kernels.active() == "triton" else cross_entropy_rows


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients chunk by chunk in the forward; the backward scales them."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                vocab_size: int, chunk: int) -> torch.Tensor:
        rows = _rows_fn()
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32) if need_grad else None
        for start in range(0, h.shape[0], chunk):
            hc = h[start:start + chunk]
            loss, dlogits = rows(matmul(hc, w, "head"), targets[start:start + chunk], vocab_size)
            if mask is not None:
                m = mask[start:start + chunk]
                loss = loss * m
                dlogits = dlogits * m[:, None].to(dlogits.dtype)
            total = total + loss.sum()
            if need_grad:
                grad_h[start:start + chunk] = matmul(dlogits, w.t(), "head")
                grad_w += matmul(hc.t(), dlogits, "head").float()
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(w.dtype))
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple:
        grad_h, grad_w = ctx.saved_tensors
        with backward_phase():  # one backward region with the step's other custom backwards
            return grad_h * grad_total.to(grad_h.dtype), grad_w * grad_total.to(grad_w.dtype), None, None, None, None


def chunked_cross_entropy_sum(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                              loss_mask: torch.Tensor | None, vocab_size: int, chunk: int) -> torch.Tensor:
    """``cross_entropy_sum(h @ w, targets, loss_mask)`` for hidden states ``h [..., embed]``
    and the output weight ``w [embed, vocab]``, ``chunk`` tokens at a time; equal to the
    plain loss in value and gradients (to rounding)."""
    if isinstance(h, DTensor) or isinstance(w, DTensor):
        raise ConfigError(
            "compute.loss_chunk works on an unsplit vocabulary; with tensor parallelism the logits are already "
            "split over the vocabulary (vocab-parallel cross-entropy): set compute.loss_chunk=0")
    tokens = "... -> (...)"  # every token in one row, whatever the leading (batch, seq) dims
    mask = None if loss_mask is None else rearrange(loss_mask, tokens).to(torch.float32)
    return _ChunkedLinearCrossEntropy.apply(rearrange(h, "... embed -> (...) embed"), w, rearrange(targets, tokens),
                                            mask, vocab_size, chunk)
