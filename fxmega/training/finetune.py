"""Fine-tuning for sequence classification: a linear head on a pooled text representation.

BERT pools with its pooler (``model.pooler``) or, without one, the [CLS] hidden state.
GPT and Llama read the final-norm hidden state of each row's last real token: with causal
attention that is the only position that has seen the whole text.

On one device or a mesh of data (ZeRO-1/2/3, FSDP) and tensor parallelism: the backbone
runs through the same pieces and the same sharded step as pre-training, and the head
(pooling, classifier, loss) runs on each rank's local tensors: its ``classes`` axis is a
name no rule splits, so it is replicated. Pipelines are refused: the pooled head needs the
attention mask on the last stage, which the pipeline does not carry yet.
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
from fxmega.core import precision, tree
from fxmega.core.device import pick_device, set_deterministic
from fxmega.core.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from fxmega.core.spec import ZEROS, ParamSpec, normal
from fxmega.data.batches import micro_batches
from fxmega.data.classification import load_classification
from fxmega.data.mlm import specials_for
from fxmega.data.tokenizer import build_tokenizer
from fxmega.models import bert, family_name, model_for
from fxmega.models.pieces import embed_inputs, run_pieces, top
from fxmega.models.registry import ModelFamily
from fxmega.ops import layers, objectives
from fxmega.ops.init import init_params
from fxmega.ops.objectives import global_count
from fxmega.ops.recompute import plain_call
from fxmega.sharding import distributed, layout
from fxmega.sharding.mesh import parse_mesh
from fxmega.storage import checkpoint, run_state
from fxmega.storage.hf_bert import load_hf_dir
from fxmega.training.optim import AdamWHyper, adamw_init, decay_mask
from fxmega.training.schedules import lr_at
from fxmega.training.step import TrainStep, compiled, trainable

Batch = dict[str, torch.Tensor]


def classifier_specs(model_cfg: Any, n_classes: int) -> dict:
    """The head ``pooled @ w + b``. ``classes`` is in no sharding rule, so it stays whole;
    ``embed`` is treated like every other weight's (FSDP/ZeRO may split it)."""
    d = model_cfg.d_model
    return {"classifier": {"w": ParamSpec((d, n_classes), ("embed", "classes"), normal(model_cfg.init_std)),
                           "b": ParamSpec((n_classes,), ("classes",), ZEROS)}}


def backbone_specs(model_cfg: Any) -> dict:
    """The model's parameters that classification reads. The LM heads (Llama's ``head``,
    BERT's ``mlm``) are left out: a parameter outside the loss has no gradient, which
    ``torch.autograd.grad`` in the step refuses."""
    model = model_for(model_cfg)
    keep = ("embed", "blocks", "pooler") if model is bert else ("embed", "blocks", "final_norm")
    return {k: v for k, v in model.param_specs(model_cfg).items() if k in keep}


def head_groups(model: ModelFamily) -> tuple[str, ...]:
    """The parameter groups the classification head reads after the blocks."""
    return ("pooler", "classifier") if model is bert else ("final_norm", "classifier")


def pooled(model: ModelFamily, params: dict, batch: Batch, cfg: Any) -> torch.Tensor:
    """One ``[batch, d_model]`` vector per row of ``batch["inputs"]`` (right-padded; see
    the module docstring for what each family pools)."""
    mask = batch.get("attention_mask")
    inputs = embed_inputs(model, batch)
    x = run_pieces(model, params, params, batch["inputs"], cfg, plain_call, head=False, inputs=inputs, valid=mask)
    return pool(model, params, x, mask, cfg)


def pool(model: ModelFamily, params: dict, x: torch.Tensor, mask: torch.Tensor | None, cfg: Any) -> torch.Tensor:
    """The pooled ``[batch, d_model]`` vector of the final hidden states ``x``."""
    if model is bert:
        return bert.pooler_output(params, x, cfg) if cfg.pooler else x[:, 0]
    rows = torch.arange(x.shape[0], device=x.device)
    last = (mask.sum(dim=1) - 1).clamp(min=0) if mask is not None else torch.full_like(rows, x.shape[1] - 1)
    # the final norm is per token: normalising only the gathered rows gives the same vectors
    return model.final_hidden(params, x[rows, last][:, None], cfg)[:, 0]


def classify(model: ModelFamily, params: dict, batch: Batch, cfg: Any) -> torch.Tensor:
    """Logits ``[batch, n_classes]``, in fp32."""
    head = params["classifier"]
    return layers.linear(pooled(model, params, batch, cfg), head["w"], head["b"]).float()


def classification_by_pieces(model: ModelFamily, cfg: Any, specs: dict, n_classes: int,
                             with_correct: bool = False) -> Callable[[dict, Batch, Any, dict], torch.Tensor]:
    """The classification loss summed over a batch as a function of ``(params, batch, call,
    layouts)`` — what ``Parallel.loss_sum_fn`` runs, and one device with ``plain_call``:
    the backbone through ``run_pieces``, then one more piece that pools, classifies and
    takes the objective on local tensors (``layout.local``: under tp the hidden states and
    the head's parameters are replicated there, so each tp rank computes the same loss).
    ``with_correct``: ``[loss sum, correct predictions]`` instead (for evaluation)."""
    objective = objectives.classification(n_classes)
    groups = head_groups(model)
    head_specs = {g: specs[g] for g in groups if g in specs}
    leaf_axes = tuple(s.axes for s in tree.leaves(head_specs))

    def on_local(x: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                 *leaves: torch.Tensor) -> torch.Tensor:
        with layout.activate(None):  # plain tensors here: the head's math, no layouts
            p = tree.unflatten_like(head_specs, list(leaves))
            head = p["classifier"]
            logits = layers.linear(pool(model, p, x, mask, cfg), head["w"], head["b"]).float()
            loss, _ = objective(logits, {"targets": targets, "loss_mask": loss_mask})
            return torch.stack([loss, _correct_sum(logits, targets, loss_mask)]) if with_correct else loss

    def head_piece(p: dict, x: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                   loss_mask: torch.Tensor) -> torch.Tensor:
        fn = layout.local(on_local, (("batch", None, "embed"), ("batch", None), ("batch",), ("batch",), *leaf_axes),
                          (None,) if with_correct else ())
        return fn(x, mask, targets, loss_mask, *tree.leaves(p))

    def run(params: dict, batch: Batch, call: Any, layouts: dict) -> torch.Tensor:
        mask = batch["attention_mask"]
        inputs = embed_inputs(model, batch)
        x = run_pieces(model, params, layouts, batch["inputs"], cfg, call, head=False, inputs=inputs, valid=mask)
        loss_mask = batch["loss_mask"] if "loss_mask" in batch else torch.ones_like(batch["targets"],
                                                                                     dtype=torch.float32)
        return call(head_piece, top(tuple(head_specs), params), top(tuple(head_specs), layouts), x, mask,
                    batch["targets"], loss_mask)

    return run


def _correct_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    right = (logits.argmax(dim=-1) == targets).float()
    return (right * loss_mask).sum() if loss_mask is not None else right.sum()


def accuracy(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of the (unmasked) examples whose largest logit is the label's."""
    count = loss_mask.sum() if loss_mask is not None else torch.tensor(float(targets.numel()))
    return _correct_sum(logits, targets, loss_mask) / count.clamp(min=1)


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
    ``fxmega.data.classification``), on one device or on ``cfg.parallel.mesh`` (data and
    tensor parallelism, ZeRO; every rank calls it, as under ``torchrun``).

    ``load`` (default ``cfg.train.load_dir``): an fxmega checkpoint (parameters only are
    read) or, for BERT, a Hugging Face model directory, whose config then replaces
    ``cfg.model``; empty: a fresh init from ``train.seed``. Training follows ``cfg.train``
    (steps, batch sizes, seq_len, compile), ``cfg.optim`` (AdamW and the LR schedule) and
    ``compute.precision`` (fp32/bf16). Validation runs every ``train.eval_interval`` steps
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
    t, mcfg, model = cfg.train, cfg.model, model_for(cfg.model)
    if mesh.size("pp") > 1:
        raise ConfigError(f"parallel.mesh={cfg.parallel.mesh!r}: fine-tuning does not run pipelined: the pooled head "
                          f"reads the attention mask on the last stage, which the pipeline does not carry yet; use "
                          f"data (dp, fsdp, ZeRO) and tensor (tp) parallelism")
    if cfg.compute.precision == "fp16":
        raise ConfigError("compute.precision=fp16 needs loss scaling, which finetune does not do yet: use bf16 or fp32")
    if t.deterministic:

        set_deterministic()

    if tokenizer is None:
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir)
    data = load_classification(data_path, tokenizer, t.seq_len, mcfg.vocab_size,
                               specials=specials_for(tokenizer, mcfg.vocab_size) if model is bert else None,
                               valid_path=valid_path, valid_fraction=cfg.data.valid_fraction, n_classes=n_classes,
                               seed=t.seed)
    if len(data.labels) < 2:
        raise DataError(f"{data_path} has a single class ({data.labels[0]!r}): classification needs at least two")
    specs = {**backbone_specs(mcfg), **classifier_specs(mcfg, len(data.labels))}
    par = None
    if mesh.world_size > 1:  # the process group, the plan of the backbone and the classifier
        par, device = distributed.setup(cfg, mesh, specs)
    else:
        device = device or pick_device(t.device)
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
    dtype = precision.compute_dtype(cfg.compute.precision)
    train_sum = classification_by_pieces(model, mcfg, specs, len(data.labels))
    eval_sum = classification_by_pieces(model, mcfg, specs, len(data.labels), with_correct=True)
    o = cfg.optim
    hyper = AdamWHyper(o.beta1, o.beta2, o.eps, o.weight_decay)
    if par is None:
        params = trainable(tree.map_leaves(lambda x: x.to(device), params))
        opt_state = adamw_init(tree.leaves(params))

        def on_one_device(piecewise: Callable) -> Callable[[list[torch.Tensor], Batch], torch.Tensor]:
            def run(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
                p = tree.unflatten_like(specs, precision.cast(flat, dtype))
                return piecewise(p, batch, plain_call, p)
            return run

        loss_sum, eval_sums = on_one_device(train_sum), on_one_device(eval_sum)
    else:  # each rank's shards of the same full tensors: the slice of the one-device init or checkpoint
        params = tree.map_with_path(lambda path, x: par.shard(par.pad(x, par.plan.params[path]), par.plan.params[path])
                                    .to(device).requires_grad_(True), params)
        opt_state = par.init_opt_state(device)
        loss_sum, eval_sums = par.loss_sum_fn(train_sum), par.loss_sum_fn(eval_sum)

    def no_grad_eval(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return eval_sums(flat, batch)

    step_fn = TrainStep(loss_sum, decay_mask(specs, o.decay_embeddings), hyper, o.clip_grad, compile=t.compile,
                        parallel=par, backend=t.compile_backend)
    evaluate = compiled(no_grad_eval, t.compile_backend) if t.compile else no_grad_eval

    def sums(batches: list[Batch]) -> tuple[float, float]:
        """Mean loss and accuracy over ``batches`` (each with a ``loss_mask``); every rank
        evaluates them all (the same numbers on every rank)."""
        loss = correct = count = 0.0
        for b in batches:
            both = evaluate(tree.leaves(params), {k: v.to(device) for k, v in b.items()})
            loss, correct, count = loss + float(both[0]), correct + float(both[1]), count + float(b["loss_mask"].sum())
        return loss / count, correct / count

    def mine(batch: Batch) -> list[Batch]:
        """This data rank's micro batches of a global batch, on the device."""
        rank, size = (par.data_rank, par.data_size) if par is not None else (0, 1)
        return [{k: v.to(device) for k, v in b.items()} for b in micro_batches(batch, t.micro_batch_size, rank, size)]

    losses: list[float] = []
    grad_norms: list[float] = []
    history: dict[int, tuple[float, float]] = {}
    for step in range(1, t.steps + 1):
        batch = data.train.global_batch(step - 1, t.global_batch_size)
        log_line = step % t.log_interval == 0 or step == t.steps
        # accuracy of the parameters that this step's loss is computed with (an extra forward)
        train_acc = sums([{**b, "loss_mask": torch.ones(len(b["targets"]))}
                          for b in micro_batches(batch, t.micro_batch_size)])[1] if log_line else 0.0
        lr = lr_at(step - 1, o, t.steps)
        params, opt_state, m = step_fn(params, opt_state, mine(batch), lr, global_count([batch]))
        losses.append(float(m["loss"]))
        grad_norms.append(float(m["grad_norm"]))
        if not bool(m["finite"]):
            if t.nonfinite == "stop":
                raise NonFiniteError(f"step {step}: non-finite loss or gradient (loss {losses[-1]}); the update was "
                                     f"not applied. Lower the learning rate (optim.lr={o.lr}), or set "
                                     f"train.nonfinite=skip to drop such steps")
            say(f"warning: step {step}: non-finite loss or gradient; the update was skipped")
        if log_line:
            recent = losses[-t.log_interval:]
            say(f"step {step:>6} | loss {sum(recent) / len(recent):.4f} | batch accuracy {train_acc:.3f} | "
                f"lr {lr:.3e} | grad norm {float(m['grad_norm']):.3f}")
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            history[step] = sums(data.valid.eval_batches(t.micro_batch_size))
            say(f"step {step}: validation loss {history[step][0]:.4f} | accuracy {history[step][1]:.3f} "
                f"({len(data.valid)} examples)")
    if par is not None:  # the full tensors on every rank, without tp padding
        full = par.full_tensors(tree.leaves(params))
        params = tree.unflatten_like(specs, [f[tuple(slice(0, n) for n in s.shape)]
                                             for f, s in zip(full, tree.leaves(specs))])
    saved = _save(cfg, params, t.steps, data.labels, data.description) if t.save_dir else ""
    if saved:
        say(f"saved model and classifier to {saved}")
    valid_loss, valid_accuracy = history[t.steps]
    return {"train_losses": losses, "grad_norms": grad_norms, "valid_loss": valid_loss,
            "valid_accuracy": valid_accuracy, "labels": data.labels, "valid_history": history, "checkpoint": saved,
            "params": params}
