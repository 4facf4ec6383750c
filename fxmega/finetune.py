"""Fine-tuning for sequence classification: a linear head on a pooled text representation.

BERT pools with its pooler (``model.pooler``) or, without one, the [CLS] hidden state.
GPT and Llama read the final-norm hidden state of each row's last real token: with causal
attention that is the only position that has seen the whole text.

Single device only (``train.device``); the sharded path can come later: the head's
``classes`` axis is a name no rule splits, so the planner would replicate it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fxmega import checkpoint, layers, precision, run_state, tree
from fxmega.config import RunConfig, to_dict
from fxmega.data.batches import micro_batches
from fxmega.data.classification import load_classification
from fxmega.data.mlm import specials_for
from fxmega.data.tokenizer import build_tokenizer
from fxmega.errors import CheckpointError, ConfigError, DataError, NonFiniteError
from fxmega.init import init_params
from fxmega.models import bert, family_name, model_for
from fxmega.models.pieces import run_pieces
from fxmega.models.registry import ModelFamily
from fxmega.objectives import global_count
from fxmega.optim import AdamWHyper, adamw_init, decay_mask
from fxmega.recompute import plain_call
from fxmega.schedules import lr_at
from fxmega.spec import ZEROS, ParamSpec, normal
from fxmega.step import TrainStep, compiled, trainable

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


def pooled(model: ModelFamily, params: dict, batch: Batch, cfg: Any) -> torch.Tensor:
    """One ``[batch, d_model]`` vector per row of ``batch["inputs"]`` (right-padded; see
    the module docstring for what each family pools)."""
    mask = batch.get("attention_mask")
    inputs = [batch[k] for k in model.EMBED_INPUTS if k in batch]
    x = run_pieces(model, params, params, batch["inputs"], cfg, plain_call, head=False, inputs=inputs, valid=mask)
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


def classification_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                            loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross-entropy over the examples (``loss_mask`` 0 leaves one out); the step
    divides by the example count, which ``objectives.count`` reads from ``targets [B]``."""
    return layers.cross_entropy_sum(logits, targets, loss_mask)


def _correct_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    right = (logits.argmax(dim=-1) == targets).float()
    return (right * loss_mask).sum() if loss_mask is not None else right.sum()


def accuracy(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of the (unmasked) examples whose largest logit is the label's."""
    count = loss_mask.sum() if loss_mask is not None else torch.tensor(float(targets.numel()))
    return _correct_sum(logits, targets, loss_mask) / count.clamp(min=1)


def _load_checkpoint(path: str, specs: dict, params: dict) -> None:
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
    print(f"initialised the {'model and classifier' if same_head else 'model'} from {found}")


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
    ``fxmega.data.classification``), on one device.

    ``load`` (default ``cfg.train.load_dir``): an fxmega checkpoint (parameters only are
    read) or, for BERT, a Hugging Face model directory, whose config then replaces
    ``cfg.model``; empty: a fresh init from ``train.seed``. Training follows ``cfg.train``
    (steps, batch sizes, seq_len, compile), ``cfg.optim`` (AdamW and the LR schedule) and
    ``compute.precision`` (fp32/bf16). Validation runs every ``train.eval_interval`` steps
    and at the end; with ``train.save_dir`` the parameters (model and head) are saved last.

    Returns ``train_losses`` (per step), ``valid_loss``, ``valid_accuracy``, ``labels``
    (class name by id), ``valid_history`` ({step: (loss, accuracy)}), ``checkpoint``
    (path or "") and ``params``."""
    load = load or cfg.train.load_dir or None
    hf = None
    if load and checkpoint.resolve(load) is None and (Path(load) / "config.json").is_file():
        if model_for(cfg.model) is not bert:
            raise ConfigError(f"--load {load} is a Hugging Face directory; only BERT ones are read (the config's "
                              f"model is {family_name(cfg.model)}): convert it first (run.py convert --from-hf)")
        from fxmega.hf_bert import load_hf_dir

        model_cfg, hf = load_hf_dir(load)
        cfg = dataclasses.replace(cfg, model=model_cfg)
    cfg = cfg.validate()
    t, mcfg, model = cfg.train, cfg.model, model_for(cfg.model)
    from fxmega.sharding.mesh import parse_mesh

    if parse_mesh(cfg.parallel.mesh).world_size != 1:
        raise ConfigError(f"parallel.mesh={cfg.parallel.mesh!r}: finetune runs on one device for now; set "
                          f"parallel.mesh=1")
    if cfg.compute.precision == "fp16":
        raise ConfigError("compute.precision=fp16 needs loss scaling, which finetune does not do yet: use bf16 or fp32")
    if t.deterministic:
        from fxmega.train import set_deterministic

        set_deterministic()
    from fxmega.train import pick_device

    device = device or pick_device(t.device)
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.data_dir)
    data = load_classification(data_path, tokenizer, t.seq_len, mcfg.vocab_size,
                               specials=specials_for(tokenizer, mcfg.vocab_size) if model is bert else None,
                               valid_path=valid_path, valid_fraction=cfg.data.valid_fraction, n_classes=n_classes,
                               seed=t.seed)
    if len(data.labels) < 2:
        raise DataError(f"{data_path} has a single class ({data.labels[0]!r}): classification needs at least two")
    print(f"data: {data.description}")

    specs = {**backbone_specs(mcfg), **classifier_specs(mcfg, len(data.labels))}
    params = init_params(specs, t.seed)
    if hf is not None:  # Hugging Face tensors may be transposed views: copy them into our own
        params = {**params, **{k: tree.map_leaves(lambda x: x.detach().clone().contiguous(), hf[k])
                               for k in specs if k != "classifier"}}
        print(f"initialised the model from the Hugging Face directory {load}")
    elif load:
        _load_checkpoint(load, specs, params)
    params = trainable(tree.map_leaves(lambda x: x.to(device), params))
    dtype = precision.compute_dtype(cfg.compute.precision)

    def loss_sum(flat: list[torch.Tensor], batch: Batch) -> torch.Tensor:
        p = tree.unflatten_like(specs, precision.cast(flat, dtype))
        return classification_loss_sum(classify(model, p, batch, mcfg), batch["targets"], batch.get("loss_mask"))

    def eval_sums(flat: list[torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = classify(model, tree.unflatten_like(specs, precision.cast(flat, dtype)), batch, mcfg)
            mask = batch["loss_mask"]
            return classification_loss_sum(logits, batch["targets"], mask), _correct_sum(logits, batch["targets"], mask)

    o = cfg.optim
    step_fn = TrainStep(loss_sum, decay_mask(specs, o.decay_embeddings), AdamWHyper(o.beta1, o.beta2, o.eps,
                        o.weight_decay), o.clip_grad, compile=t.compile, backend=t.compile_backend)
    evaluate = compiled(eval_sums, t.compile_backend) if t.compile else eval_sums
    opt_state = adamw_init(tree.leaves(params))

    def sums(batches: list[Batch]) -> tuple[float, float]:
        """Mean loss and accuracy over ``batches`` (each with a ``loss_mask``)."""
        loss = correct = count = 0.0
        for b in batches:
            b = {k: v.to(device) for k, v in b.items()}
            batch_loss, batch_correct = evaluate(tree.leaves(params), b)
            loss, correct, count = loss + float(batch_loss), correct + float(batch_correct), count + float(
                b["loss_mask"].sum())
        return loss / count, correct / count

    losses: list[float] = []
    history: dict[int, tuple[float, float]] = {}
    for step in range(1, t.steps + 1):
        batch = data.train.global_batch(step - 1, t.global_batch_size)
        micro = micro_batches(batch, t.micro_batch_size)
        log_line = step % t.log_interval == 0 or step == t.steps
        # accuracy of the parameters that this step's loss is computed with (an extra forward)
        train_acc = sums([{**b, "loss_mask": torch.ones(len(b["targets"]))} for b in micro])[1] if log_line else 0.0
        lr = lr_at(step - 1, o, t.steps)
        params, opt_state, m = step_fn(params, opt_state, [{k: v.to(device) for k, v in b.items()} for b in micro],
                                       lr, global_count([batch]))
        losses.append(float(m["loss"]))
        if not bool(m["finite"]):
            if t.nonfinite == "stop":
                raise NonFiniteError(f"step {step}: non-finite loss or gradient (loss {losses[-1]}); the update was "
                                     f"not applied. Lower the learning rate (optim.lr={o.lr}), or set "
                                     f"train.nonfinite=skip to drop such steps")
            print(f"warning: step {step}: non-finite loss or gradient; the update was skipped")
        if log_line:
            recent = losses[-t.log_interval:]
            print(f"step {step:>6} | loss {sum(recent) / len(recent):.4f} | batch accuracy {train_acc:.3f} | "
                  f"lr {lr:.3e} | grad norm {float(m['grad_norm']):.3f}")
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            history[step] = sums(data.valid.eval_batches(t.micro_batch_size))
            print(f"step {step}: validation loss {history[step][0]:.4f} | accuracy {history[step][1]:.3f} "
                  f"({len(data.valid)} examples)")
    saved = _save(cfg, params, t.steps, data.labels, data.description) if t.save_dir else ""
    if saved:
        print(f"saved model and classifier to {saved}")
    valid_loss, valid_accuracy = history[t.steps]
    return {"train_losses": losses, "valid_loss": valid_loss, "valid_accuracy": valid_accuracy,
            "labels": data.labels, "valid_history": history, "checkpoint": saved, "params": params}
