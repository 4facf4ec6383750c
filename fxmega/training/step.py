"""The training step: forward, ``torch.autograd.grad`` and the AdamW update in one compiled
graph.

``TrainStep(...)(params, opt_state, micro_batches, lr)`` runs one optimizer step over a
rank's share of the global batch, given as a list of micro batches (Megatron's gradient
accumulation). With one micro batch the whole step is a single graph. With more, the first
ones run an *accumulate* graph (forward + backward, gradients added into fp32 buffers) and
the last runs the *update* graph (forward + backward + clip + AdamW), so the number of
graphs stays two whatever the accumulation count, instead of unrolling the loop.

The loss of each micro batch is a sum over its tokens divided by the token count of the
whole global batch, so the gradients add up to those of the global mean whatever the
micro-batch size, accumulation count or (with ``fxmega.sharding``) data-parallel size.

Inputs are donated (see ``fxmega.training.optim``): params and optimizer state are updated in place
and returned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

from fxmega.compiler.inspect import aot_eager_backend
from fxmega.core import tree
from fxmega.ops import aux_loss
from fxmega.ops.objectives import global_count
from fxmega.ops.phases import backward_phase
from fxmega.optim.optimizer import Optimizer, ParamRole
from fxmega.parallel.runtime import Parallel
from fxmega.training.update import Update

LossSumFn = Callable[[list[torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]


def enable_autograd_in_compile() -> None:
    """Let dynamo trace ``torch.autograd.grad`` inside a compiled function (the flag exists
    and is needed in torch 2.13; older versions trace it without the flag)."""
    if hasattr(torch._dynamo.config, "trace_autograd_ops"):
        torch._dynamo.config.trace_autograd_ops = True


def compiled(fn: Callable, backend: str = "inductor", options: dict | None = None) -> Callable:
    """``fn`` under ``torch.compile`` as fxmega compiles every step: one whole graph
    (``fullgraph``: a graph break is an error, not a silent split) with static shapes;
    ``options`` are inductor settings (ignored by other backends)."""
    if backend == "aot_eager":

        return torch.compile(fn, fullgraph=True, dynamic=False, backend=aot_eager_backend())
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options or None)


def trainable(params: tree.Tree) -> tree.Tree:
    """Mark every parameter as a leaf that requires grad (in place; returns the tree)."""
    for p in tree.leaves(params):
        p.requires_grad_(True)
    return params


class _GatheredValue(torch.autograd.Function):
    """``full``'s value (a view: no kernel); backward, the gradient goes to ``p``, the
    parameter ``full`` was gathered from."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with backward_phase():  # one backward region with the step's other custom backwards
            return grad, None


class TrainStep:
    """A compiled (or eager) training step over flat parameter lists.

    Parameters must be leaf tensors with ``requires_grad=True`` (``trainable`` makes them
    so); the step differentiates with respect to them and updates them in place.

    ``loss_sum_fn(flat_params, batch)`` returns the summed loss of one micro batch on this
    rank. With ``parallel`` (a ``fxmega.parallel.runtime.Parallel``) the parameters are this
    rank's shards, and the step adds the cross-rank work: gradient reduction over the data
    axes (bucketed; reduce-scatter for ZeRO), the global gradient norm over all shards, the
    update of this rank's optimizer shard, and the all-gather of updated ZeRO-1/2 shards.
    """

    def __init__(self, loss_sum_fn: LossSumFn, roles: list[ParamRole], optimizer: Optimizer, clip_grad: float,
                 compile: bool = True, parallel: Parallel | None = None, backend: str = "inductor",
                 options: dict | None = None, sign_rates: tuple[float, ...] = (), meter_names: tuple[str, ...] = (),
                 gather_params_first: bool = False) -> None:
        self.loss_sum_fn = loss_sum_fn
        self.meter_names = meter_names  # what the model's layers report (``aux_loss.measure``), if anything
        # ZeRO-1/2's all-gather of the updated shards at the start of the next step's first graph
        # (``parallel.overlap_param_gather``) rather than at the end of the update
        self.gather_params_first = gather_params_first
        self.update = Update(optimizer, roles, clip_grad, sign_rates, refresh=not gather_params_first)
        self.parallel = parallel
        self.compiled = compile
        self._accum_buffers: list[torch.Tensor] | None = None
        self._norm_weights: torch.Tensor | None = None
        if compile:
            enable_autograd_in_compile()
            self._accumulate = compiled(self._accumulate_fn, backend, options)
            self._update = compiled(self._update_fn, backend, options)
        else:
            self._accumulate, self._update = self._accumulate_fn, self._update_fn

    # -- the two graphs ---------------------------------------------------------------
    def _loss_and_grads(self, flat_params: list[torch.Tensor], batch: dict[str, torch.Tensor],
                        inv_tokens: torch.Tensor, meter: torch.Tensor | None, gather: bool = False,
                        accumulating: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        # The parameters are leaf tensors that require grad, so no requires_grad_() is
        # traced (torch 2.11's dynamo cannot trace it; 2.13's can). So is the meter.
        used = self._gathered(flat_params) if gather else flat_params
        with aux_loss.gradient_scale(inv_tokens), aux_loss.metering(meter, self.meter_names):
            loss_sum = self.loss_sum_fn(used, batch)
        wrt = flat_params if meter is None else [*flat_params, meter]
        with backward_phase():
            grads = list(torch.autograd.grad(loss_sum * inv_tokens, wrt))
        stats = grads.pop().detach() if meter is not None else loss_sum.new_zeros(0)  # the layers' statistics, summed
        if self.parallel is not None:
            grads = self.parallel.grads.micro_grads(grads)
        if gather and accumulating:  # the step's later micro batches read the inputs: make them whole
            with torch.no_grad():
                for p, full in zip(flat_params, used):
                    if full is not p:
                        p.copy_(full)
        return loss_sum.detach(), grads, stats

    def gather_params(self, flat_params: list[torch.Tensor]) -> None:
        """All-gather this rank's updated optimizer shards into every replica, in place (what
        the update does last unless ``gather_params_first``)."""
        with torch.no_grad():
            self.parallel.grads.refresh_params(flat_params, self.parallel.grads.opt_views(flat_params))

    def _gathered(self, flat_params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters the forward reads under ``gather_params_first``: the buckets'
        gathers, first layers first, as new tensors rather than copied into the inputs
        (inductor fuses copies into the inputs into one kernel that waits for every gather
        before the forward's first op), each read through ``_GatheredValue`` — a view, so no
        kernel ties a later layer's bucket to an earlier layer's compute — whose gradient
        goes to the leaf ``p``. The inputs keep only this rank's shards current;
        ``gather_params`` refreshes them."""
        grads = self.parallel.grads
        with torch.no_grad():
            gathered = grads.gathered_params(flat_params, grads.opt_views(flat_params), forward_order=True)
        return [p if full is p else _GatheredValue.apply(p, full) for p, full in zip(flat_params, gathered)]

    def _accumulate_fn(self, flat_params: list[torch.Tensor], accum: list[torch.Tensor],
                       batch: dict[str, torch.Tensor], inv_tokens: torch.Tensor,
                       meter: torch.Tensor | None, gather: bool = False) -> list[torch.Tensor]:
        loss_sum, grads, stats = self._loss_and_grads(flat_params, batch, inv_tokens, meter, gather, accumulating=True)
        with torch.no_grad():
            torch._foreach_add_(accum, grads)
        return [loss_sum, stats]

    def _update_fn(self, flat_params: list[torch.Tensor], opt_state: dict, accum: list[torch.Tensor] | None,
                   batch: dict[str, torch.Tensor], inv_tokens: torch.Tensor, lr: torch.Tensor,
                   norm_weights: torch.Tensor | None, unscale: torch.Tensor | None,
                   meter: torch.Tensor | None, gather: bool = False) -> list[torch.Tensor]:
        loss_sum, grads, stats = self._loss_and_grads(flat_params, batch, inv_tokens, meter, gather)
        par = self.parallel
        with torch.no_grad():
            if accum is not None:
                torch._foreach_add_(accum, grads)
                grads = accum
            if par is not None:
                loss_sum = par.groups.sum_over_tokens(loss_sum)
        return [loss_sum, stats, *self.update(flat_params, grads, opt_state, lr, par, norm_weights, unscale)]

    # -- one optimizer step -----------------------------------------------------------
    def __call__(self, params: tree.Tree, opt_state: dict, micro_batches: list[dict[str, torch.Tensor]],
                 lr: float, n_tokens: torch.Tensor | None = None,
                 loss_scale: torch.Tensor | float | None = None) -> tuple[tree.Tree, dict, dict[str, torch.Tensor]]:
        """Run one step (launched: nothing is read back to the host); returns ``(params,
        opt_state, metrics)`` with ``loss`` (mean over the global batch's tokens) and
        ``grad_norm`` (before clipping) as 0-dim tensors, ``finite`` (whether the update
        was applied) and ``nonfinite_grads`` (a flag per local gradient).

        ``n_tokens`` is the global batch's loss-token count; it defaults to this rank's
        micro batches (right for a single device). ``loss_scale`` (fp16) multiplies the loss
        before the backward; the gradients are divided by it again before clipping (a
        tensor input: a new scale does not recompile the step)."""
        flat = tree.leaves(params)
        device = flat[0].device
        if n_tokens is None:
            n_tokens = global_count(micro_batches)
        inv_tokens = (1.0 / n_tokens).to(device, non_blocking=True)
        grad_weight, unscale = inv_tokens, None  # what the summed loss is multiplied by for the backward
        if loss_scale is not None:
            loss_scale = torch.as_tensor(loss_scale, dtype=torch.float32, device=device)
            grad_weight, unscale = inv_tokens * loss_scale, 1.0 / loss_scale
        lr_t = torch.full((), lr, dtype=torch.float32, device=device)  # a fill: no host-to-device copy
        if self.parallel is not None and self._norm_weights is None:
            self._norm_weights = self.parallel.grads.norm_weights(device)
        loss_sum = torch.zeros((), device=device)
        n = len(self.meter_names)
        meter = torch.zeros(n, device=device, requires_grad=True) if n else None
        stats = torch.zeros(n, device=device)
        accum = None
        gather = self.gather_params_first  # in the step's first graph (a bool: each value compiles once)
        if len(micro_batches) > 1:
            accum = self._accumulation_buffers(flat)
            for batch in micro_batches[:-1]:
                micro_loss, micro_stats = self._accumulate(flat, accum, batch, grad_weight, meter, gather)
                loss_sum, stats = loss_sum + micro_loss, stats + micro_stats
                gather = False
        if self.parallel is not None and len(micro_batches) > 1:
            loss_sum = self.parallel.groups.sum_over_tokens(loss_sum)  # the update graph sums only its own
        last_loss, last_stats, grad_norm, finite, bad = self._update(flat, opt_state, accum, micro_batches[-1],
                                                                     grad_weight, lr_t, self._norm_weights, unscale,
                                                                     meter, gather)
        loss = (loss_sum + last_loss) * inv_tokens
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "nonfinite_grads": bad}
        if meter is not None:  # every data rank's layers and micro batches (tp ranks hold the same)
            stats = stats + last_stats
            metrics["meter"] = stats if self.parallel is None else self.parallel.groups.sum_over_tokens(stats)
        return params, opt_state, metrics

    def _accumulation_buffers(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._accum_buffers is None:
            if self.parallel is not None:
                device = flat[0].device
                self._accum_buffers = [torch.zeros(s, device=device) for s in self.parallel.grads.accum_shapes()]
            else:
                self._accum_buffers = [torch.zeros_like(p, requires_grad=False) for p in flat]
        else:
            torch._foreach_zero_(self._accum_buffers)
        return self._accum_buffers


class EvalStep:
    """Summed loss of a batch without gradients, compiled like the train step."""

    def __init__(self, loss_sum_fn: LossSumFn, compile: bool = True, backend: str = "inductor") -> None:
        self.loss_sum_fn = loss_sum_fn
        self._fn = compiled(self._eval, backend) if compile else self._eval

    def _eval(self, flat_params: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self.loss_sum_fn(flat_params, batch)

    def __call__(self, params: tree.Tree, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._fn(tree.leaves(params), batch)
