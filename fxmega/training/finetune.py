"""Fine-tuning for sequence classification: a linear head on a pooled text representation.

The model is ``fxmega.models.classifier.classifier``: the family's embedding and blocks,
and a head that pools (BERT: its pooler, or the [CLS] hidden state; GPT and Llama: the
final-norm hidden state of each row's last real token, the only position that has seen
the whole text under causal attention) and classifies. It is a model family like any
other, and a fine-tune is a ``Run`` of it: the same pieces, the same sharded step, the
same pipeline, optimizer and loss scaling as pre-training, on one device or any mesh of
data (ZeRO-1/2/3, FSDP), tensor (+sequence) and pipeline parallelism; the head's
``classes`` axis is a name no rule splits, so it is replicated,
and under pp it runs on the last stage, which is given the attention mask.
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
from fxmega.core.errors import CheckpointError, ConfigError, DataError
from fxmega.core.log import get_logger
from fxmega.data.batches import micro_batches
from fxmega.data.classification import load_classification
from fxmega.data.mlm import specials_for
from fxmega.data.sources import Data
from fxmega.data.tokenizer import build_tokenizer
from fxmega.models import bert, family_name, loss_by_pieces, model_for
from fxmega.models.classifier import classifier
from fxmega.ops.init import init_params
from fxmega.parallel import distributed
from fxmega.parallel.runtime import Parallel
from fxmega.sharding.mesh import parse_mesh
from fxmega.storage import checkpoint, run_state
from fxmega.storage.hf_bert import load_hf_dir
from fxmega.training import tracking
from fxmega.training.evaluate import my_micro_batches, one_device_loss_sum
from fxmega.training.logs import RunLog
from fxmega.training.outcome import Pending
from fxmega.training.run import Run
from fxmega.training.step import compiled

Batch = dict[str, torch.Tensor]
log = get_logger(__name__)


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


class FineTune:
    """A fine-tuning run: a ``Run`` (``fxmega.training.run``) of the classifier on the labelled
    rows — the same compiled steps, optimizer, loss scaling and non-finite policy as
    pre-training — initialised from a checkpoint or a Hugging Face directory, and the
    validation that also reports accuracy. ``finetune`` is the loop around it; tests drive
    ``run.do_step`` directly, as they do for pre-training."""

    def __init__(self, cfg: RunConfig, data_path: str | Path, valid_path: str | Path | None = None,
                 load: str | None = None, n_classes: int | None = None, tokenizer: object = None,
                 device: torch.device | None = None) -> None:
        load = load or cfg.train.load_dir or None
        hf = None
        if load and checkpoint.resolve(load) is None and (Path(load) / "config.json").is_file():
            if model_for(cfg.model) is not bert.FAMILY:
                raise ConfigError(f"--load {load} is a Hugging Face directory; only BERT ones are read (the config's "
                                  f"model is {family_name(cfg.model)}): convert it first (run.py convert --from-hf)")
            model_cfg, hf = load_hf_dir(load)
            cfg = dataclasses.replace(cfg, model=model_cfg)
        mesh = parse_mesh(cfg.parallel.mesh)
        cfg = cfg.validate(mesh.data_size)
        t, mcfg, family = cfg.train, cfg.model, model_for(cfg.model)
        if cfg.compute.loss_chunk:
            raise ConfigError(f"compute.loss_chunk={cfg.compute.loss_chunk} chunks the projection onto the vocabulary, "
                              f"which a classification head does not have: set compute.loss_chunk=0")
        if tokenizer is None:
            tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir)
        specials = specials_for(tokenizer, mcfg.vocab_size) if family is bert.FAMILY else None
        splits = load_classification(data_path, tokenizer, t.seq_len, mcfg.vocab_size, specials=specials,
                                     valid_path=valid_path, valid_fraction=cfg.data.valid_fraction,
                                     n_classes=n_classes, seed=t.seed)
        if len(splits.labels) < 2:
            raise DataError(f"{data_path} has a single class ({splits.labels[0]!r}): classification needs at least two")
        model = classifier(family, mcfg, len(splits.labels))
        par: Parallel | None = None
        if mesh.world_size > 1:  # the process group, the plan of the backbone and the classifier
            par, device = distributed.setup(cfg, mesh, model)
        self.cfg, self.splits, self.model, self.parallel = cfg, splits, model, par
        self.say = log.info if par is None or par.rank == 0 else (lambda text: None)
        self.say(f"data: {splits.description}")
        data = Data(splits.train, splits.valid, tokenizer, splits.description)
        self.run = run = Run(cfg, par, device, model=model, data=data)
        if hf is not None or load:  # the whole model, then each rank's slice of it
            full = init_params(run.specs, t.seed)
            if hf is not None:
                full |= {k: hf[k] for k in run.specs if k != "classifier"}
                self.say(f"initialised the model from the Hugging Face directory {load}")
            else:
                _load_checkpoint(load, run.specs, full, self.say)
            self._set_params(dict(tree.items(full)))
        eval_objective = model.eval_objective(mcfg)
        self._eval_objective = eval_objective
        if not run.pipelined:
            sums = one_device_loss_sum(run.specs, mcfg, cfg.compute, model, eval_objective) if par is None else \
                par.loss_sum_fn(loss_by_pieces(mcfg, par.compute, model, eval_objective))

            def no_grad_sums(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
                with torch.no_grad():
                    return sums(flat, batch)
            self._eval_sums = compiled(no_grad_sums, t.compile_backend) if t.compile else no_grad_sums

    def _set_params(self, full: dict[str, torch.Tensor]) -> None:
        """Copy full tensors (by path) into this rank's parameters, in place: a pipeline's
        stages hold the very tensors the run's parameters are."""
        par = self.parallel
        with torch.no_grad():
            for path, p in tree.items(self.run.params):
                p.copy_(full[path] if par is None else par.shards.local_of(full[path], path))

    def scores(self, batches: list[Batch]) -> tuple[float, float]:
        """Mean loss and accuracy over ``batches`` (each with a ``loss_mask``); the same
        numbers on every rank. Every rank evaluates them all, or under pp each data
        replica's pipeline its share of them as whole global batches."""
        run, t = self.run, self.cfg.train
        count = float(sum(b["loss_mask"].sum() for b in batches))
        if run.pipelined:
            both = sum(run.train_step.eval_sum(my_micro_batches(g, t.micro_batch_size, self.parallel, run.device),
                                               self._eval_objective)
                       for g in eval_batches_of(batches, t.global_batch_size))
        else:
            both = sum(self._eval_sums(tree.leaves(run.params), {k: v.to(run.device) for k, v in b.items()})
                       for b in batches)
        return float(both[0]) / count, float(both[1]) / count

    def batch_accuracy(self) -> float:
        """Accuracy on the next training batch, with the parameters its step will start from."""
        t = self.cfg.train
        batch = self.splits.train.global_batch(self.run.step, t.global_batch_size)
        return self.scores([{**b, "loss_mask": torch.ones(len(b["targets"]))}
                            for b in micro_batches(batch, t.micro_batch_size)])[1]

    def validate(self) -> tuple[float, float]:
        """Mean loss and accuracy on the whole validation split."""
        return self.scores(self.splits.valid.eval_batches(self.cfg.train.micro_batch_size))

    def full_params(self) -> dict:
        """The whole model and head as full tensors on every rank, without tp padding."""
        shapes = {path: s.shape for path, s in tree.items(self.run.specs)}
        return tree.map_with_path(lambda path, f: f[tuple(slice(0, n) for n in shapes[path])],
                                  self.run.full_params())


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
    ``compute`` (fp32/bf16/fp16 with loss scaling, activation recompute). Validation runs every
    ``train.eval_interval`` steps and at the end; with ``train.save_dir`` the parameters (model
    and head) are saved last.

    Returns ``train_losses`` and ``grad_norms`` (per step), ``valid_loss``, ``valid_accuracy``, ``labels``
    (class name by id), ``valid_history`` ({step: (loss, accuracy)}), ``checkpoint``
    (path or "") and ``params``."""
    job = FineTune(cfg, data_path, valid_path, load, n_classes, tokenizer, device)
    t, say = job.cfg.train, job.say
    main = job.parallel is None or job.parallel.rank == 0
    run_log = RunLog(t.log_jsonl, t.tensorboard_dir, tracking.sinks(job.cfg, to_dict(job.cfg))) if main else RunLog()
    try:
        losses, grad_norms, history = _loop(job, run_log)
    finally:
        run_log.close()
    params = job.full_params()
    saved = _save(job.cfg, params, t.steps, job.splits.labels, job.splits.description) if t.save_dir else ""
    if saved:
        say(f"saved model and classifier to {saved}")
    valid_loss, valid_accuracy = history[t.steps]
    return {"train_losses": losses, "grad_norms": grad_norms, "valid_loss": valid_loss,
            "valid_accuracy": valid_accuracy, "labels": job.splits.labels, "valid_history": history,
            "checkpoint": saved, "params": params}


def _loop(job: FineTune, run_log: RunLog) -> tuple[list[float], list[float], dict[int, tuple[float, float]]]:
    """The steps, read from the device at log and validation steps (as pre-training does),
    each step a record of ``run_log``; the losses, gradient norms and validation history."""
    run, t, say = job.run, job.cfg.train, job.say
    losses: list[float] = []
    grad_norms: list[float] = []
    history: dict[int, tuple[float, float]] = {}
    pending: list[Pending] = []  # steps launched since the last report
    while run.step < t.steps:
        step = run.step + 1
        log_line = step % t.log_interval == 0 or step == t.steps
        evaluate = (t.eval_interval and step % t.eval_interval == 0) or step == t.steps
        train_acc = job.batch_accuracy() if log_line else 0.0  # an extra forward, on log steps only
        pending.append(run.launch_step())
        if not (log_line or evaluate):
            continue
        outcomes, steps, pending = run.settle(pending), pending, []
        losses += [out["loss"] for out in outcomes]
        grad_norms += [out["grad_norm"] for out in outcomes]
        records = [{"step": p.step, **out} for p, out in zip(steps, outcomes)]
        if log_line:
            out, recent = outcomes[-1], losses[-t.log_interval:]
            records[-1]["batch_accuracy"] = train_acc
            say(f"step {step:>6} | loss {sum(recent) / len(recent):.4f} | batch accuracy {train_acc:.3f} | "
                f"lr {out['lr']:.3e} | grad norm {out['grad_norm']:.3f}")
        if evaluate:
            history[step] = job.validate()
            records[-1] |= {"valid_loss": history[step][0], "valid_accuracy": history[step][1]}
            say(f"step {step}: validation loss {history[step][0]:.4f} | accuracy {history[step][1]:.3f} "
                f"({len(job.splits.valid)} examples)")
        for record in records:
            run_log.write(record)
    return losses, grad_norms, history
