"""Fine-tuning for sequence classification: a linear head on a pooled text representation.

The model is ``fxmega.models.classifier.Classifier``: the family's embedding and blocks,
and a head that pools (BERT: its pooler, or the [CLS] hidden state; GPT and Llama: the
final-norm hidden state of each row's last real token, the only position that has seen
the whole text under causal attention) and classifies. It is a model family like any
other, so fine-tuning runs the same pieces, the same sharded step and the same pipeline
as pre-training, on one device or any mesh of data (ZeRO-1/2/3, FSDP), tensor (+sequence)
and pipeline parallelism; the head's ``classes`` axis is a name no rule splits, so it is
replicated, and under pp it runs on the last stage, which is given the attention mask.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fxmega.config import RunConfig, to_dict
from fxmega.core import tree
from fxmega.core.device import pick_device, set_deterministic
from fxmega.core.errors import CheckpointError, ConfigError, DataError
from fxmega.data.batches import micro_batches
from fxmega.data.classification import load_classification
from fxmega.data.mlm import specials_for
from fxmega.data.tokenizer import build_tokenizer
from fxmega.models import bert, family_name, loss_by_pieces, model_for
from fxmega.models.classifier import Classifier
from fxmega.ops.init import init_params
from fxmega.ops.objectives import global_count
from fxmega.sharding import distributed
from fxmega.sharding.mesh import parse_mesh
from fxmega.sharding.runtime import Parallel
from fxmega.storage import checkpoint, run_state
from fxmega.storage.hf_bert import load_hf_dir
from fxmega.training.evaluate import my_micro_batches, one_device_loss_sum
from fxmega.training.optim import AdamWHyper, adamw_init, decay_mask
from fxmega.training.outcome import settle
from fxmega.training.pipeline_step import PipelineStep
from fxmega.training.schedules import lr_at
from fxmega.training.state import TrainState
from fxmega.training.step import TrainStep, compiled, trainable

Batch = dict[str, torch.Tensor]


def eval_batches_of(batches: list[Batch], size: int) -> list[Batch]:
    """``batches`` (each with a ``loss_mask``) regrouped into batches of ``size`` rows, the
    last filled up with copies of row 0 that ``loss_mask`` leaves out: a pipeline's schedule
    takes whole global batches."""
    rows = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    n = len(rows["targets"])
    fill = -n % size
    if fill:
        rows = {k: torch.cat([v, v[:1].expand(fill, *v.shape[1:])]) for k, v in rows.items()}
        rows["loss_mask"][n:] = 0
    return [{k: v[i:i + size] for k, v in rows.items()} for i in range(0, n + fill, size)]


def _load_checkpoint(path: str, specs: dict, params: dict, say: Callable[[str], None] = print) -> None:
    """Fill ``params`` (in place) from an fxmega checkpoint; its classifier too when it has
    one of the same shape (continuing a fine-tune), else the head stays freshly initialised."""
    found = checkpoint.resolve(path)
    if found is None:
        raise CheckpointError(f"--load {path}: no fxmega checkpoint there (no meta.json, nor a 'latest' pointer) "
                              f"and no Hugging Face config.json: give a checkpoint root or step directory")
    saved = checkpoint.saved_shapes(found)
    same_head = all(saved.get(f"params.{p}") == s.shape for p, s in tree.items(specs["classifier"], "classifier."))
    keep = specs if same_head else {k: v for k, v in specs.items() if k != "classifier"}
    target = SimpleNamespace(parallel=None, specs=keep, local_specs=keep, params={k: params[k] for k in keep})
    run_state.load_into(target, found, params_only=True)
    say(f"initialised the {'model and classifier' if same_head else 'model'} from {found}")


def _save(cfg: RunConfig, params: dict, step: int, labels: list, description: str) -> str:
    tensors = {f"params.{p}": t.detach() for p, t in tree.items(params)}
    meta = {"format": run_state.FORMAT, "step": step, "params_only": True, "config": to_dict(cfg),
            "model_family": family_name(cfg.model), "task": "classification", "labels": labels,
            "data": description, "saved_at": time.time()}
    saver = checkpoint.Checkpointer(cfg.train.save_dir, cfg.train.keep_last)
    return str(saver.save(step, tensors, meta))


def finetune(cfg: RunConfig, data_path: str | Path, valid_path: str | Path | None = None, load: str | None = None,
             n_classes: int | None = None, tokenizer: object = None,
             device: torch.device | None = None) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` plus a classifier head on ``data_path`` (JSON lines, see
    ``fxmega.data.classification``), on one device or on ``cfg.parallel.mesh`` (data, tensor
    and pipeline parallelism, ZeRO; every rank calls it, as under ``torchrun``).

    ``load`` (default ``cfg.train.load_dir``): an fxmega checkpoint (parameters only are
    read) or, for BERT, a Hugging Face model directory, whose config then replaces
    ``cfg.model``; empty: a fresh init from ``train.seed``. Training follows ``cfg.train``
    (steps, batch sizes, seq_len, compile), ``cfg.optim`` (AdamW and the LR schedule) and
    ``compute`` (fp32/bf16, activation recompute). Validation runs every ``train.eval_interval`` steps
    and at the end; with ``train.save_dir`` the parameters (model and head) are saved last.

    Returns ``train_losses`` and ``grad_norms`` (per step), ``valid_loss``, ``valid_accuracy``, ``labels``
    (class name by id), ``valid_history`` ({step: (loss, accuracy)}), ``checkpoint``
    (path or "") and ``params``."""
    load = load or cfg.train.load_dir or None
    hf = None
    if load and checkpoint.resolve(load) is None and (Path(load) / "config.json").is_file():
        if model_for(cfg.model) is not bert:
            raise ConfigError(f"--load {load} is a Hugging Face directory; only BERT ones are read (the config's "
                              f"model is {family_name(cfg.model)}): convert it first (run.py convert --from-hf)")

        model_cfg, hf = load_hf_dir(load)
        cfg = dataclasses.replace(cfg, model=model_cfg)
    mesh = parse_mesh(cfg.parallel.mesh)
    cfg = cfg.validate(mesh.data_size)
    t, mcfg, family = cfg.train, cfg.model, model_for(cfg.model)
    if cfg.compute.precision == "fp16":
        raise ConfigError("compute.precision=fp16 needs loss scaling, which finetune does not do yet: use bf16 or fp32")
    if cfg.compute.loss_chunk:
        raise ConfigError(f"compute.loss_chunk={cfg.compute.loss_chunk} chunks the projection onto the vocabulary, "
                          f"which a classification head does not have: set compute.loss_chunk=0")
    if t.deterministic:
        set_deterministic()

    if tokenizer is None:
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir)
    data = load_classification(data_path, tokenizer, t.seq_len, mcfg.vocab_size,
                               specials=specials_for(tokenizer, mcfg.vocab_size) if family is bert else None,
                               valid_path=valid_path, valid_fraction=cfg.data.valid_fraction, n_classes=n_classes,
                               seed=t.seed)
    if len(data.labels) < 2:
        raise DataError(f"{data_path} has a single class ({data.labels[0]!r}): classification needs at least two")
    model = Classifier(family, mcfg, len(data.labels))
    specs = model.param_specs(mcfg)
    par: Parallel | None = None
    if mesh.world_size > 1:  # the process group, the plan of the backbone and the classifier
        par, device = distributed.setup(cfg, mesh, model)
    else:
        device = device or pick_device(t.device)
    pipelined = par is not None and par.plan.pipeline is not None
    main = par is None or par.rank == 0
    say = print if main else (lambda *a, **k: None)
    say(f"data: {data.description}")

    params = init_params(specs, t.seed)
    if hf is not None:  # Hugging Face tensors may be transposed views: copy them into our own
        params = {**params, **{k: tree.map_leaves(lambda x: x.detach().clone().contiguous(), hf[k])
                               for k in specs if k != "classifier"}}
        say(f"initialised the model from the Hugging Face directory {load}")
    elif load:
        _load_checkpoint(load, specs, params, say)
    o = cfg.optim
    hyper = AdamWHyper(o.beta1, o.beta2, o.eps, o.weight_decay)
    eval_objective = model.eval_objective()
    step_fn: TrainStep | PipelineStep
    if par is None:
        params = trainable(tree.map_leaves(lambda x: x.to(device), params))
        opt_state = adamw_init(tree.leaves(params))
        loss_sum = one_device_loss_sum(specs, mcfg, cfg.compute, model)
        eval_sums = one_device_loss_sum(specs, mcfg, cfg.compute, model, eval_objective)
    else:  # each rank's shards of the same full tensors: the slice of the one-device init or checkpoint
        full = dict(tree.items(params))
        params = tree.map_with_path(lambda path, _: par.shards.local_of(full[path], path).to(device)
                                    .requires_grad_(True), par.specs)  # this rank's pipeline stages only, under pp
        opt_state = par.shards.init_opt_state(device)
        loss_sum = par.loss_sum_fn(loss_by_pieces(mcfg, par.compute, model))
        eval_sums = par.loss_sum_fn(loss_by_pieces(mcfg, par.compute, model, eval_objective))
    decay = decay_mask(specs if par is None else par.specs, o.decay_embeddings)
    if pipelined:
        # PipelineStage registers the stage's parameters as nn.Parameters (same storage)
        params = tree.map_leaves(lambda x: torch.nn.Parameter(x.detach(), requires_grad=True), params)
        step_fn = PipelineStep(par, mcfg, model, model.objective(), params, decay, hyper, o.clip_grad,
                               cfg.grad_accum_steps(par.groups.data_size), t.compile, device, backend=t.compile_backend)
    else:
        step_fn = TrainStep(loss_sum, decay, hyper, o.clip_grad, compile=t.compile, parallel=par,
                            backend=t.compile_backend)

    def no_grad_eval(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return eval_sums(flat, batch)

    evaluate = compiled(no_grad_eval, t.compile_backend) if t.compile else no_grad_eval

    def mine(batch: Batch) -> list[Batch]:
        return my_micro_batches(batch, t.micro_batch_size, par, device)

    def sums(batches: list[Batch]) -> tuple[float, float]:
        """Mean loss and accuracy over ``batches`` (each with a ``loss_mask``); the same
        numbers on every rank. Every rank evaluates them all, or under pp each data
        replica's pipeline its share of them as whole global batches."""
        count = float(sum(b["loss_mask"].sum() for b in batches))
        if pipelined:
            both = sum(step_fn.eval_sum(mine(g), eval_objective) for g in eval_batches_of(batches, t.global_batch_size))
        else:
            both = sum(evaluate(tree.leaves(state.params), {k: v.to(device) for k, v in b.items()}) for b in batches)
        return float(both[0]) / count, float(both[1]) / count

    losses: list[float] = []
    grad_norms: list[float] = []
    history: dict[int, tuple[float, float]] = {}
    state = TrainState(params, opt_state)
    local_paths = tree.paths(specs if par is None else par.specs)
    for step in range(1, t.steps + 1):
        batch = data.train.global_batch(step - 1, t.global_batch_size)
        log_line = step % t.log_interval == 0 or step == t.steps
        # accuracy of the parameters that this step's loss is computed with (an extra forward)
        train_acc = sums([{**b, "loss_mask": torch.ones(len(b["targets"]))}
                          for b in micro_batches(batch, t.micro_batch_size)])[1] if log_line else 0.0
        lr = lr_at(step - 1, o, t.steps)
        state.params, state.opt_state, m = step_fn(state.params, state.opt_state, mine(batch), lr,
                                                   global_count([batch]))
        state.step = step
        out = settle(state, m, lr, None, policy=t.nonfinite, diagnostics_dir=t.diagnostics_dir,
                     local_paths=local_paths, rank=0 if par is None else par.rank, say=say)
        losses.append(out["loss"])
        grad_norms.append(out["grad_norm"])
        if log_line:
            recent = losses[-t.log_interval:]
            say(f"step {step:>6} | loss {sum(recent) / len(recent):.4f} | batch accuracy {train_acc:.3f} | "
                f"lr {lr:.3e} | grad norm {out['grad_norm']:.3f}")
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            history[step] = sums(data.valid.eval_batches(t.micro_batch_size))
            say(f"step {step}: validation loss {history[step][0]:.4f} | accuracy {history[step][1]:.3f} "
                f"({len(data.valid)} examples)")
    params = state.params
    if par is not None:  # the full tensors on every rank, without tp padding
        shapes = {path: s.shape for path, s in tree.items(specs)}
        params = tree.map_with_path(lambda path, f: f[tuple(slice(0, n) for n in shapes[path])],
                                    par.shards.full_params(params, specs))
    saved = _save(cfg, params, t.steps, data.labels, data.description) if t.save_dir else ""
    if saved:
        say(f"saved model and classifier to {saved}")
    valid_loss, valid_accuracy = history[t.steps]
    return {"train_losses": losses, "grad_norms": grad_norms, "valid_loss": valid_loss,
            "valid_accuracy": valid_accuracy, "labels": data.labels, "valid_history": history, "checkpoint": saved,
            "params": params}
