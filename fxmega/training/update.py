"""The one optimizer update every step kind ends with, pipelined or not, inside its compiled
graph: gradients reduced over the data axes (ZeRO: reduce-scattered to this rank's
optimizer shard), the copies of a parameter held by several pipeline ranks summed (the
tied embedding on the first and last stage), the fp16 loss scale undone, the global norm
clipped, and AdamW applied only where every gradient on every rank is finite — a step with
a non-finite gradient leaves parameters, moments and step count as they were.

The caller computes the gradients (``fxmega.training.step``: ``autograd.grad`` in the same graph;
``fxmega.training.pipeline_step``: torch's pipeline schedule) and hands them here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxmega.optim.optimizer import Optimizer, ParamRole
from fxmega.parallel.runtime import Parallel
from fxmega.training.optim import clip_by_global_norm_, per_tensor_norms, sign_update_

Grads = list[torch.Tensor]


@dataclass(frozen=True)
class Update:
    """The optimizer (``fxmega.optim``: AdamW by default), each flat parameter's role (its
    weight decay, whether it is a hidden matrix) and the global-norm clip (0: none).
    ``sign_rates`` (per flat parameter, empty: all 0): a parameter with a rate is not
    trained by the optimizer; its gradient is a load count, out of the norm, and
    ``optim.sign_update_`` moves it (``ParamSpec.sign_rate``)."""

    optimizer: Optimizer
    roles: list[ParamRole]
    clip_grad: float
    sign_rates: tuple[float, ...] = ()
    # ZeRO-1/2: all-gather the updated shards into every replica at the end (False: the next
    # step gathers them first, ``parallel.overlap_param_gather``)
    refresh: bool = True

    def __call__(self, flat: list[torch.Tensor], grads: Grads, opt_state: dict, lr: torch.Tensor,
                 parallel: Parallel | None = None, norm_weights: torch.Tensor | None = None,
                 unscale: torch.Tensor | None = None,
                 reduce_shared: Callable[[Grads], Grads] | None = None) -> list[torch.Tensor]:
        """Update ``flat`` (this rank's parameters) and ``opt_state`` in place from ``grads``
        (this rank's, not yet reduced). ``parallel``: the rank's ``Parallel`` (None on one
        device); ``norm_weights``: how much each local gradient counts in the global norm
        (a replicated tensor once, a shard once per shard); ``unscale``: 1 / the fp16 loss
        scale; ``reduce_shared``: sums the gradients of parameters several pipeline ranks
        hold. Returns ``[grad_norm, finite, nonfinite flag per gradient]``. Under the
        distributed optimizer the update runs over the segments this rank owns
        (``GradientSync.owners``: each one's parameter)."""
        with torch.no_grad():
            targets, owners = flat, list(range(len(flat)))
            if parallel is not None:
                if reduce_shared is not None and parallel.grads.flat is not None:
                    grads, reduce_shared = reduce_shared(grads), None  # before the buckets cut tensors apart
                grads = parallel.grads.final_grads(grads)
                targets, owners = parallel.grads.opt_views(flat), parallel.grads.owners
            if reduce_shared is not None:
                grads = reduce_shared(grads)
            if unscale is not None:  # fp16: the gradients of the scaled loss, back to true size
                grads = torch._foreach_mul(grads, unscale)
            rates = [self.sign_rates[i] if self.sign_rates else 0.0 for i in owners]
            counted = [k for k, rate in enumerate(rates) if rate]
            loads = [grads[k] for k in counted]
            if counted:  # the optimizer sees zeros there: its state and the parameter stay put
                grads = [torch.zeros_like(g) if k in counted else g for k, g in enumerate(grads)]
            norms = per_tensor_norms(grads)
            grad_norm = clip_by_global_norm_(grads, self.clip_grad, norm_weights,
                                             parallel.groups.sum_over_world if parallel is not None else None, norms)
            finite = torch.isfinite(grad_norm)  # not finite anywhere: the update is not applied
            self.optimizer.update(targets, grads, opt_state, lr, [self.roles[i] for i in owners], finite.float())
            sign_update_([targets[k] for k in counted], loads, [rates[k] for k in counted], finite.float())
            if parallel is not None and self.refresh:
                parallel.grads.refresh_params(flat, targets)
            bad = ~torch.isfinite(norms)
            if owners != list(range(len(flat))):  # per parameter: its one segment here, or none
                where = {i: k for k, i in enumerate(owners)}
                none = bad.new_zeros(())
                bad = torch.stack([bad[where[i]] if i in where else none for i in range(len(flat))])
        return [grad_norm, finite, bad]
