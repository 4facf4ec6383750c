"""Activation recompute (Megatron's activation checkpointing) for whole blocks or parts.

``none`` keeps every activation the backward needs. ``selective`` keeps the outputs of the
matmuls (the expensive ops), of the attention kernel and of the reducing collectives, and
recomputes everything else in the block — norms, activations, RoPE, residual adds: cheap
FLOPs whose inputs are kept anyway. ``full`` keeps only each block's input and the
attention kernel's output, and runs the rest of the block's forward again in the backward.

Why the attention kernel's output is kept even by ``full``: inside fxmega's compiled step,
which traces ``torch.autograd.grad``, recompute is done by torch's
forward-loss-backward rematerialisation pass, and that pass refuses ops tagged as random;
every SDPA op carries that tag (for its dropout). Nothing is lost where it matters: the
flash and memory-efficient kernels keep only the output and the log-sum-exp and recompute
the attention probabilities in their own backward, which is what Megatron's selective
recompute of the attention core buys on devices without those kernels.

All modes go through ``torch.utils.checkpoint`` with an op-level policy; the compiled graph
stays one graph with the recompute in it (tests/test_recompute.py measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxmega.ops import aux_loss
from fxmega.sharding import layout

_ops = torch.ops
# Kept under selective recompute: matmuls, and collectives that reduce (recomputing them
# would repeat communication). Gathers are always recomputed (ZeRO-3 relies on it).
_SAVE = {
    _ops.aten.mm.default,
    _ops.aten.addmm.default,
    _ops.aten.bmm.default,
    _ops.aten.baddbmm.default,
    _ops.aten.linear.default,
    _ops._c10d_functional.all_reduce.default,
    _ops._c10d_functional.reduce_scatter_tensor.default,
}


def draws_random(func: Any) -> bool:
    """Ops tagged as drawing random numbers (SDPA, for its dropout) cannot be recomputed."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    keep = func in _SAVE or draws_random(func)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE


def _full_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if draws_random(func) else CheckpointPolicy.MUST_RECOMPUTE


# Module level on purpose: a context_fn defined inside a compiled function is not supported
# by dynamo.
def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def _full_context() -> Any:
    return create_selective_checkpoint_contexts(_full_policy)


CONTEXTS = {"selective": _selective_context, "full": _full_context}
POLICIES = {"selective": _selective_policy, "full": _full_policy}


def inductor_options(has_recompute_regions: bool) -> dict | None:
    """Inductor settings for a step with recompute regions (``compute.recompute`` or ZeRO-3's
    re-gather). Inductor's ``reorder_for_locality`` pass moves each node next to the first
    use of its inputs; in a graph that holds forward, loss and backward together it pulls
    the recomputed ops back up into the forward, where they keep their outputs alive until
    the backward — undoing the recompute. Measured on a 4-block GPT (tests/test_recompute.py):
    full recompute's peak 38 MiB with the pass, 18 MiB without; no recompute 40 MiB."""
    return {"reorder_for_locality": False} if has_recompute_regions else None


def mode_for_block(mode: str, index: int, first_n: int) -> str:
    """The recompute mode of block ``index``: ``mode`` for the first ``first_n`` blocks
    (all blocks when ``first_n`` is 0), ``none`` after."""
    return mode if (first_n == 0 or index < first_n) else "none"


def in_forward_context(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under the activation layout (``fxmega.sharding.layout``) and the auxiliary
    losses' scale and meter (``fxmega.ops.aux_loss``) active now, also when
    ``torch.utils.checkpoint`` runs it again in the backward, where the step's forward has
    left them. Without it an eager recompute ran unsharded attention in place of the
    context-parallel one, and a mixture of experts without its balancing terms: other ops
    than the forward's, which the checkpoint refuses. A compiled step traces the recompute
    inside the forward's context (and dynamo refuses the global switches inside a
    checkpoint), so there ``fn`` is returned as it is."""
    forward_layout, forward_losses = layout.active(), aux_loss.step_state()
    if torch.compiler.is_compiling() or (forward_layout is None and all(s is None for s in forward_losses)):
        return fn

    def run(*args: Any) -> Any:
        with layout.activate(forward_layout), aux_loss.restored(forward_losses):
            return fn(*args)

    return run


def checkpointed(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """``fn`` with its activations recomputed in the backward as ``mode`` says."""
    if mode == "none":
        return fn

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: no backward to recompute for
            return fn(*args)
        return checkpoint(in_forward_context(fn), *args, use_reentrant=False, context_fn=CONTEXTS[mode])

    return run


def plain_call(fn: Callable[..., Any], params: Any, layouts: Any, *args: Any, recompute: str = "none") -> Any:
    """A ``PieceCall`` for one device: run the piece, recomputed as asked."""
    return checkpointed(fn, recompute)(params, *args)
