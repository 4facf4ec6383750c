"""The training step of a pipelined run: torch.distributed.pipelining runs the stages'
forward and backward passes over the microbatches in the schedule's order, then one
compiled update graph reduces gradients over the data axes, sums the tied embedding's
gradient between the first and last stage only (their embedding group), clips by the global norm and applies AdamW.

A stage is a thin ``nn.Module`` shell (what PipelineStage wants) whose forward calls a
pure function of the stage's parameters: the embedding on the first stage, its blocks,
the head on the last. That function is compiled with torch.compile (TP/SP collectives
inside it) except under the zero-bubble schedules, which split each backward into an
input part and a weight part by walking the stage's autograd graph — a compiled stage is
one opaque autograd node, and torch refuses the combination — so those run eagerly.

The loss is the objective's sum over each microbatch divided by the loss-term count of
the whole global batch, as in ``fxmega.training.step``, so pp runs equal single-device runs.
Only the residual stream passes from stage to stage. What the pieces read from the batch
besides the tokens — the embedding's ``EMBED_INPUTS`` (BERT's token types), the attention
mask of a padded batch (every block, and a classifier's head) — is given to every stage as
keyword arguments, which torch's schedules split into microbatches like the tokens and
hand to each stage's forward; what the objective reads (``objective.batch_keys``: the
targets and the loss mask) travels as the schedule's one target tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed import pipelining

from fxmega.core import tree
from fxmega.core.log import get_logger
from fxmega.models.family import ModelConfig, ModelFamily
from fxmega.models.pieces import embed_inputs, output_axes, run_pieces
from fxmega.ops import aux_loss
from fxmega.ops.objectives import Objective, global_count
from fxmega.optim.optimizer import Optimizer, ParamRole
from fxmega.parallel.runtime import Parallel
from fxmega.sharding import layout
from fxmega.sharding.pipeline import SCHEDULES, SPLIT_BACKWARD, Stage, check_microbatches
from fxmega.training.step import compiled
from fxmega.training.update import Update

log = get_logger(__name__)


RESIDUAL = ("batch", "seq", "embed")


def _stage_tree(local: dict, stage: Stage, model: ModelFamily) -> dict:
    """The part of this rank's parameter tree that ``stage`` reads (same tensors)."""
    return stage.params_of(local, model.EMBED_PARAMS, model.head_groups(local))


class _StageModule(nn.Module):
    """What PipelineStage runs: the stage function over the stage's parameters, which are
    registered here (PipelineStage reads ``parameters()`` for weight gradients)."""

    def __init__(self, fn: Callable[..., torch.Tensor], params: list[torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.stage_params = nn.ParameterList(params)

    def forward(self, x: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        return self.fn(list(self.stage_params), x, **batch)


class PipelineStep:
    """Same interface as ``fxmega.training.step.TrainStep`` (``__call__`` returns params, optimizer
    state and metrics), plus ``eval_sum`` for validation."""

    def __init__(self, par: Parallel, cfg: ModelConfig, model: ModelFamily, objective: Objective, params: dict,
                 roles: list[ParamRole],
                 optimizer: Optimizer,
                 clip_grad: float, n_micro: int, compile: bool, device: torch.device,
                 backend: str = "inductor", options: dict | None = None, sign_rates: tuple[float, ...] = (),
                 meter_names: tuple[str, ...] = ()) -> None:
        plan, pipe = par.plan, par.plan.pipeline
        check_microbatches(pipe.schedule, n_micro, pipe.pp, pipe.virtual)
        self.par, self.cfg, self.model, self.objective, self.pipe = par, cfg, model, objective, pipe
        self._output_axes = output_axes(model)
        self._head_inputs = model.HEAD_INPUTS
        self._objective_now = objective  # what ``_loss_fn`` takes (eval may ask for another)
        self._target_keys: list[tuple[str, torch.dtype]] = []  # what the packed target holds, in order
        self.update, self.device = Update(optimizer, roles, clip_grad, sign_rates), device
        self.flat = tree.leaves(params)
        self.compiled = compile
        self.compiled_stages = compile and pipe.schedule not in SPLIT_BACKWARD
        # the layers' statistics (aux_loss.measure) reach a meter through the stages' backward,
        # which accumulates into every leaf; a split backward differentiates named weights only
        self.meter_names = meter_names if pipe.schedule not in SPLIT_BACKWARD else ()
        if meter_names and not self.meter_names and par.rank == 0:
            log.info(f"note: the {pipe.schedule} schedule's split backward hands gradients to named weights only: "
                     f"the layers' statistics ({', '.join(meter_names[:3])}, ...) are not collected (the losses "
                     f"they come with still train)")
        if compile and not self.compiled_stages and par.rank == 0:  # said, not silently done
            log.info(f"note: the {pipe.schedule} schedule splits each backward into input and weight gradients by "
                     f"walking the stage's autograd graph, which a compiled stage hides: its stages run eagerly; "
                     f"the update graph is compiled")
        self.pp_rank = par.groups.coords["pp"]
        self.my_stages = pipe.stages_of(self.pp_rank)
        self.has_first = any(s.index == 0 for s in self.my_stages)
        self.has_last = any(s.index == pipe.n_stages - 1 for s in self.my_stages)
        self._inv_tokens = torch.ones((), device=device)
        pp_group = par.groups.group(("pp",)).get_group()
        stages = []
        for s in self.my_stages:
            sub = _stage_tree(params, s, model)
            fn = self._stage_fn(s, _stage_tree(par.shards.layout_tree, s, model), sub)
            if self.compiled_stages:
                fn = compiled(fn, backend, options)
            stages.append(pipelining.PipelineStage(_StageModule(fn, tree.leaves(sub)), s.index, pipe.n_stages,
                                                   device, group=pp_group))
        self.stages = stages  # this rank's PipelineStages (fxmega.planning.fake traces them one by one)
        cls = getattr(pipelining, SCHEDULES[pipe.schedule][0])
        self.schedule = cls(stages[0] if SCHEDULES[pipe.schedule][1] == "one" else stages, n_micro,
                            loss_fn=self._loss_fn, scale_grads=False)
        # parameters held by several pp ranks (the tied embedding on the first and last
        # stage): their gradients are summed among those ranks only, over a group of just
        # them (Megatron's embedding group); the stages between take no part. Every rank
        # makes every such group (a collective), in sorted order.
        paths = [p for p, _ in tree.items(par.shards.layout_tree)]
        owner_sets = sorted({tuple(plan.pp_owners(p)) for p in plan.params if len(plan.pp_owners(p)) > 1})
        groups = {owners: par.groups.pipeline_subgroup(owners) for owners in owner_sets}
        mine = {owners: [paths.index(p) for p in plan.params if tuple(plan.pp_owners(p)) == owners]
                for owners in owner_sets if self.pp_rank in owners}
        # (group, the flat indices of its parameters) for each group this rank is in
        self._shared: list[tuple[dist.ProcessGroup, list[int]]] = [(groups[o], idx) for o, idx in mine.items()]
        counted = torch.tensor([1.0 if min(plan.pp_owners(p)) == self.pp_rank else 0.0 for p in paths], device=device)
        counted = counted[torch.tensor(par.grads.owners, device=device)]  # per optimizer view (a flat segment)
        self._norm_weights = par.grads.norm_weights(device) * counted  # each element of the model once
        self._loss_group = par.groups.group(("pp", *par.groups.token_axes))  # cp: each rank its chunks' sum
        self._update = compiled(self._update_fn, backend) if compile else self._update_fn

    # -- the stage function and the loss ----------------------------------------------
    def _stage_fn(self, stage: Stage, lays: dict, like: dict):
        """The stage's pieces (``run_pieces``, as every other forward) over its parameters:
        what torch's pipeline passes between stages are local tensors, so the stage wraps
        them as the DTensors they were under tp and unwraps its output."""
        par = self.par

        def run(flat: list[torch.Tensor], x: torch.Tensor, **given: torch.Tensor) -> torch.Tensor:
            if par.context is not None:  # each cp rank's gradients cover its own chunks: sum them
                flat = [par.context.sum_grads(p) for p in flat]
            params = tree.unflatten_like(like, flat)
            with layout.activate(par.activations):
                batch = {k: self._wrap(v, None) for k, v in given.items()}
                x = self._wrap(x, None if stage.embed else RESIDUAL)  # the tokens, or the residual stream
                x = run_pieces(self.model, params, lays, x, self.cfg, par.call, embed=stage.embed, head=stage.head,
                               inputs=embed_inputs(self.model, batch), valid=batch.get("attention_mask"),
                               positions=batch.get("positions"), compute=par.compute,
                               head_inputs=[batch.get(k) for k in self._head_inputs])
                return self._unwrap(x, self._output_axes if stage.head else RESIDUAL)

        return run

    def _wrap(self, x: torch.Tensor, axes: tuple | None) -> torch.Tensor:
        """A tensor received from the previous stage (or the tokens) as the DTensor it was."""
        tp = self.par.activations
        return x if tp is None else tp.wrap(x, axes)

    def _unwrap(self, x: torch.Tensor, axes: tuple) -> torch.Tensor:
        tp = self.par.activations
        return x if tp is None else tp.unwrap(x, axes)

    def _loss_fn(self, outputs: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The objective's sum over a microbatch, divided by the global count (vocab-parallel
        under tp: the logits stay split). ``packed`` holds ``objective.batch_keys``."""
        par = self.par
        batch = {k: self._wrap(packed[:, i].to(dtype), None) for i, (k, dtype) in enumerate(self._target_keys)}
        with layout.activate(par.activations):
            loss, _ = self._objective_now(self._wrap(outputs, self._output_axes), batch)
        if par.activations is not None:
            loss = par.activations.to_replicated_local(loss)
        return loss * self._inv_tokens

    def stage_kwargs(self, micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """What every stage is given besides the tokens or the residual stream (whole global
        batch rows; the schedule splits them): the embedding's inputs the batch has, the
        attention mask when the batch has one, the tokens' positions under cp (every block
        takes them), and the head's inputs."""
        keys = [*(k for k in self.model.EMBED_INPUTS if k in micro[0]), "attention_mask", "positions",
                *self._head_inputs]
        return {k: torch.cat([m[k] for m in micro]) for k in dict.fromkeys(keys) if k in micro[0]}

    def _packed_target(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """``objective.batch_keys`` present in the batch as one float64 tensor ``[batch, keys,
        ...]`` (exact for token ids below 2**53 and for fp32 masks), unpacked by ``_loss_fn``."""
        keys = [k for k in self._objective_now.batch_keys if k in micro[0]]
        self._target_keys = [(k, micro[0][k].dtype) for k in keys]
        return torch.stack([torch.cat([m[k] for m in micro]).to(torch.float64) for k in keys], dim=1)

    def _run_schedule(self, micro: list[dict[str, torch.Tensor]], train: bool,
                      objective: Objective | None = None) -> torch.Tensor:
        self._objective_now = objective if objective is not None else self.objective
        losses: list[torch.Tensor] = []
        args = (torch.cat([m["inputs"] for m in micro]),) if self.has_first else ()
        kwargs = {"target": self._packed_target(micro), "losses": losses} if self.has_last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs, **self.stage_kwargs(micro))
        mine = torch.stack([loss.detach() for loss in losses]).sum(0) if losses else self._zero_sum()
        return funcol.all_reduce(mine, "sum", self._loss_group)  # only the last stage has it

    def _zero_sum(self) -> torch.Tensor:
        """What a stage without the loss adds: zeros of the objective's sum's shape."""
        return torch.zeros(self._objective_now.sum_shape, device=self.device)

    # -- one optimizer step -----------------------------------------------------------
    def _update_fn(self, flat: list[torch.Tensor], grads: list[torch.Tensor], opt_state: dict, lr: torch.Tensor,
                   norm_weights: torch.Tensor, unscale: torch.Tensor | None) -> list[torch.Tensor]:
        return self.update(flat, grads, opt_state, lr, self.par, norm_weights, unscale, self._sum_shared)

    @property
    def shared_group_sizes(self) -> list[int]:
        """How many ranks each group that this rank sums shared parameters' gradients over
        spans (the embedding group: 2, first and last stage; none on the stages between)."""
        return [group.size() for group, _ in self._shared]

    def _sum_shared(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        out = list(grads)
        for group, indices in self._shared:  # one all-reduce per group, of its parameters packed
            summed = funcol.all_reduce(torch.cat([grads[i].reshape(-1) for i in indices]), "sum", group)
            offset = 0
            for i in indices:
                out[i] = summed[offset:offset + grads[i].numel()].view_as(grads[i])
                offset += grads[i].numel()
        return out

    def __call__(self, params: tree.Tree, opt_state: dict, micro_batches: list[dict[str, torch.Tensor]],
                 lr: float, n_tokens: torch.Tensor | None = None,
                 loss_scale: torch.Tensor | float | None = None) -> tuple[tree.Tree, dict, dict[str, torch.Tensor]]:
        if n_tokens is None:
            n_tokens = global_count(micro_batches)
        scale = 1.0 if loss_scale is None else torch.as_tensor(loss_scale, dtype=torch.float32, device=self.device)
        # fp16: the backward runs on the scaled loss
        self._inv_tokens = scale * (1.0 / n_tokens).to(self.device, non_blocking=True)
        unscale = None if loss_scale is None else 1.0 / scale
        for p in self.flat:
            p.grad = None
        n = len(self.meter_names)
        meter = torch.zeros(n, device=self.device, requires_grad=True) if n else None
        with aux_loss.gradient_scale(self._inv_tokens), aux_loss.metering(meter, self.meter_names):
            loss = self._run_schedule(micro_batches, train=True) / scale
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.flat]
        for p in self.flat:
            p.grad = None  # the update owns them now
        lr_t = torch.full((), lr, dtype=torch.float32, device=self.device)  # a fill: no host-to-device copy
        grad_norm, finite, bad = self._update(self.flat, grads, opt_state, lr_t, self._norm_weights, unscale)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "nonfinite_grads": bad}
        if meter is not None:  # each stage's layers, every micro batch; summed over stages and data ranks
            stats = meter.grad if meter.grad is not None else torch.zeros_like(meter)
            metrics["meter"] = funcol.all_reduce(stats.detach(), "sum", self._loss_group)
        return params, opt_state, metrics

    def eval_sum(self, micro_batches: list[dict[str, torch.Tensor]],
                 objective: Objective | None = None) -> torch.Tensor:
        """Summed loss of this data rank's micro batches, reduced over the pipeline and the
        data axes (every rank returns the same value); ``objective`` instead of the step's
        (e.g. a classifier's loss and right answers)."""
        self._inv_tokens = torch.ones((), device=self.device)
        with torch.no_grad():
            return self._run_schedule(micro_batches, train=False, objective=objective)
