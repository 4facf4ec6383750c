"""Validation loss: the mean objective over ``train.eval_iters`` fixed global batches of the
validation split — the same sequences whatever the mesh — and ``run.py eval``, which takes
it of a checkpoint's parameters (``fxmega.inference.model_loader``: no optimizer state, no training
step) on any mesh. Perplexity is ``exp(mean loss)`` over those tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fxmega.config import RunConfig
from fxmega.core import precision, tree
from fxmega.core.compute import ComputeConfig
from fxmega.data.batches import micro_batches, my_rows
from fxmega.data.sources import build_data
from fxmega.inference.model_loader import LoadedModel, load_model
from fxmega.models import lm_loss_sum, loss_by_pieces
from fxmega.models.family import ModelConfig, ModelFamily
from fxmega.ops import fp8, kernels, matmul, recompute
from fxmega.ops.objectives import Objective, global_count
from fxmega.optim.adamw import AdamW, AdamWHyper
from fxmega.optim.optimizer import ParamRole
from fxmega.parallel.runtime import Parallel
from fxmega.training.pipeline_step import PipelineStep
from fxmega.training.step import EvalStep, LossSumFn

Batch = dict[str, torch.Tensor]


def my_host_micro_batches(batch: Batch, micro: int, parallel: Parallel | None) -> list[Batch]:
    """What this rank reads of a global batch, still on the host: its data rank's micro
    batches (under cp its chunks of them)."""
    if parallel is None:
        return micro_batches(batch, micro)
    return [parallel.local_batch(b) for b in micro_batches(batch, micro, parallel.groups.data_rank,
                                                           parallel.groups.data_size)]


def my_step_input(source: Any, step: int, batch_size: int, micro: int,
                  parallel: Parallel | None) -> tuple[list[Batch], torch.Tensor]:
    """Step ``step``'s input on the host: this rank's micro batches of the global batch of
    ``batch_size`` and the loss-term count of the whole global batch. A source that reads
    rows alone (``batch_rows``: windows of a corpus or samples of a dataset, no loss mask)
    reads only this data rank's rows, and the count is rows x tokens; otherwise the whole
    global batch is read (its loss mask decides the count)."""
    read_rows = getattr(source, "batch_rows", None)
    if read_rows is None:
        batch = source.global_batch(step, batch_size)
        return my_host_micro_batches(batch, micro, parallel), global_count([batch])
    rank, size = (parallel.groups.data_rank, parallel.groups.data_size) if parallel is not None else (0, 1)
    mine = read_rows(step, batch_size, my_rows(batch_size, micro, rank, size))
    if "loss_mask" in mine:
        raise ValueError(f"{type(source).__name__}.batch_rows gave a loss mask: the global count would need every "
                         f"row; such a source must not define batch_rows")
    micros = micro_batches(mine, micro)
    if parallel is not None:
        micros = [parallel.local_batch(b) for b in micros]
    return micros, torch.tensor(float(batch_size * mine["targets"][0].numel()))


def to_device(micros: list[Batch], device: torch.device) -> list[Batch]:
    """Host micro batches on ``device``; asynchronous copies (from pinned memory on CUDA, as
    the prefetcher leaves them), so the host does not wait for the device."""
    return [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in micros]


def my_micro_batches(batch: Batch, micro: int, parallel: Parallel | None, device: torch.device) -> list[Batch]:
    """This data rank's micro batches of a global batch, on ``device``."""
    return to_device(my_host_micro_batches(batch, micro, parallel), device)


def one_device_loss_sum(specs: dict, model_cfg: ModelConfig, compute: ComputeConfig | None,
                        model: ModelFamily | None = None, objective: Objective | None = None,
                        reference: dict | None = None) -> LossSumFn:
    """The objective's summed loss over a batch on one device, from the flat fp32 parameters:
    cast to the compute dtype (autograd casts the gradients back), run piece by piece.
    ``model`` and ``objective`` default to the config's family and its objective;
    ``reference`` is a frozen tree an objective may read (``training.reference``), cast alike."""
    dtype = precision.compute_dtype(compute.precision)

    def loss_sum(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        frozen = None if reference is None else \
            tree.unflatten_like(specs, precision.cast(tree.leaves(reference), dtype))
        return lm_loss_sum(tree.unflatten_like(specs, precision.cast(flat, dtype)), batch, model_cfg, compute=compute,
                           model=model, objective=objective, reference=frozen)
    return loss_sum


def micro_sums(step: EvalStep, params: dict, device: torch.device) -> Callable[[list[Batch]], torch.Tensor]:
    """``sums`` for ``mean_loss`` from an eval step: the summed loss of each micro batch, added."""
    return lambda micros: sum((step(params, m) for m in micros), torch.zeros((), device=device))


def mean_loss(cfg: RunConfig, valid_data: Any, sums: Callable[[list[Batch]], torch.Tensor],
              parallel: Parallel | None, device: torch.device, summed_over_data: bool = False) -> float:
    """The mean loss per counted term over ``cfg.train.eval_iters`` global batches of
    ``valid_data``; ``sums(micro batches)`` is this data rank's summed loss of its micro
    batches (``summed_over_data``: already the sum over every data rank, as a pipeline's is)."""
    t = cfg.train
    total = torch.zeros((), device=device)
    count = 0.0
    with kernels.use(cfg.compute.kernels), matmul.use(fp8.recipe_for(cfg.compute.fp8, device)):
        for i in range(t.eval_iters):
            batch = valid_data.global_batch(i, t.global_batch_size)
            count += float(global_count([batch]))
            total += sums(my_micro_batches(batch, t.micro_batch_size, parallel, device))
    if parallel is not None and not summed_over_data:
        total = parallel.groups.sum_over_tokens(total)
    return float(total) / count


def eval_sums(loaded: LoadedModel) -> tuple[Callable[[list[Batch]], torch.Tensor], bool]:
    """``(sums, summed_over_data)`` for ``mean_loss`` on a loaded model: the compiled eval
    step, or on a pipeline the schedule's forward over the stages."""
    cfg, par = loaded.cfg, loaded.parallel
    t = cfg.train
    if par is not None and par.plan.pipeline is not None:
        # the schedule's forward carries activations between the stages; no update is ever run
        params = tree.map_leaves(lambda p: torch.nn.Parameter(p, requires_grad=True), loaded.params)
        loaded.params = params
        roles = [ParamRole(decay=False)] * len(tree.leaves(params))
        no_update = AdamW(AdamWHyper())  # evaluation never steps: the stage needs an optimizer only to exist
        pipe = PipelineStep(par, cfg.model, loaded.model, loaded.model.objective(cfg.model), params, roles,
                            no_update, 0.0, cfg.grad_accum_steps(par.groups.data_size), t.compile, loaded.device,
                            backend=t.compile_backend, options=recompute.inductor_options(False))
        return pipe.eval_sum, True
    if par is None:
        loss_sum = one_device_loss_sum(loaded.specs, cfg.model, cfg.compute)
    else:
        loss_sum = par.loss_sum_fn(loss_by_pieces(cfg.model, par.compute))
    return micro_sums(EvalStep(loss_sum, compile=t.compile, backend=t.compile_backend), loaded.params,
                      loaded.device), False


def evaluate_checkpoint(cfg: RunConfig, parallel: Parallel | None = None,
                        device: torch.device | None = None) -> dict[str, Any]:
    """Load ``cfg.train.load_dir``'s parameters and evaluate them; returns loss, perplexity and
    token count (every rank takes part; every rank gets the same numbers)."""
    loaded = load_model(cfg, parallel, device, with_tokenizer=False, command="eval")
    data = build_data(cfg, loaded.model.objective(cfg.model).name)
    sums, summed = eval_sums(loaded)
    loss = mean_loss(cfg, data.valid, sums, parallel, loaded.device, summed)
    t = cfg.train
    tokens = t.eval_iters * t.global_batch_size * t.seq_len
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "checkpoint": t.load_dir,
            "data": data.description}


def report(result: dict[str, Any]) -> str:
    return (f"eval: {result['checkpoint']} on {result['data']} ({result['tokens']:,} tokens): "
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}")
