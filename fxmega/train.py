"""The training loop on one device: data → step → metrics → eval → checkpoint → sample.

Everything that is computed lives elsewhere (model, step, optimizer, data); this file wires
them together. ``Run`` holds a run's state and does one step at a time (tests and
benchmarks drive it directly); ``train`` adds the progress bar, logs, evaluation,
checkpoints and the closing sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from fxmega import checkpoint, tree
from fxmega.config import RunConfig, to_dict
from fxmega.data.batches import MockTokens, TokenWindows, micro_batches
from fxmega.data.corpus import ensure_shakespeare
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.errors import ConfigError, DataError
from fxmega.generate import generate
from fxmega.init import count_params, init_params
from fxmega.logs import RunLog
from fxmega.metrics import Throughput, device_peak, model_flops_per_token
from fxmega.models import family_name, lm_loss_sum, model_for
from fxmega.optim import AdamWHyper, adamw_init, decay_mask
from fxmega.schedules import lr_at
from fxmega.step import EvalStep, TrainStep, trainable


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available: use train.device=cpu or auto")
    return torch.device(name)


def build_data(cfg: RunConfig) -> tuple[Any, Any, ByteTokenizer | None]:
    """Train and validation sources, and the tokenizer (None for mock data)."""
    t, d = cfg.train, cfg.data
    if d.source == "mock":
        return (MockTokens(cfg.model.vocab_size, t.seq_len, t.seed, "train"),
                MockTokens(cfg.model.vocab_size, t.seq_len, t.seed, "valid"), None)
    tokenizer = ByteTokenizer()
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's "
                          f"{tokenizer.vocab_size} tokens: set model.vocab_size >= {tokenizer.vocab_size}")
    path = ensure_shakespeare(d.data_dir) if d.source == "shakespeare" else d.source
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data.source={str(path)!r} as UTF-8 text: {e}") from None
    tokens = tokenizer.encode_array(text)
    n_valid = max(t.seq_len + 2, int(len(tokens) * d.valid_fraction))
    return (TokenWindows(tokens[:-n_valid], t.seq_len, t.seed, "train"),
            TokenWindows(tokens[-n_valid:], t.seq_len, t.seed, "valid"), tokenizer)


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Run:
    """A run's model, parameters, optimizer state, steps and data, on one device."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg.validate()
        t = cfg.train
        self.device = pick_device(t.device)
        self.model = model_for(cfg.model)
        self.specs = self.model.param_specs(cfg.model)
        self.params = trainable(init_params(self.specs, t.seed, self.device))
        self.opt_state = adamw_init(tree.leaves(self.params))
        self.step = 0  # optimizer steps taken
        hyper = AdamWHyper(cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay)
        self.train_step = TrainStep(self.loss_sum, self.specs, decay_mask(self.specs, cfg.optim.decay_embeddings),
                                    hyper, cfg.optim.clip_grad, compile=t.compile)
        self.eval_step = EvalStep(self.loss_sum, compile=t.compile)
        self.train_data, self.valid_data, self.tokenizer = build_data(cfg)

    def loss_sum(self, params: dict, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss_sum(params, batch, self.cfg.model)

    def do_step(self) -> dict[str, float]:
        """One optimizer step on the next global batch; returns loss, lr and grad norm."""
        t = self.cfg.train
        batch = self.train_data.global_batch(self.step, t.global_batch_size)
        micros = [_to(b, self.device) for b in micro_batches(batch, t.micro_batch_size)]
        lr = lr_at(self.step, self.cfg.optim, t.steps)
        self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, micros, lr)
        self.step += 1
        return {"loss": float(metrics["loss"]), "lr": lr, "grad_norm": float(metrics["grad_norm"])}

    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_iters`` fixed batches."""
        t = self.cfg.train
        total, count = 0.0, 0
        for i in range(t.eval_iters):
            batch = _to(self.valid_data.global_batch(i, t.micro_batch_size), self.device)
            total += float(self.eval_step(self.params, batch))
            count += batch["targets"].numel()
        return total / count

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds. The data position is the step: batches are a function of it."""
        return {"params": self.params, "opt": self.opt_state,
                "meta": {"step": self.step, "config": str(to_dict(self.cfg))}}

    def save(self, root: str) -> str:
        return str(checkpoint.save(root, self.step, self.state()))

    def resume(self, root: str) -> bool:
        """Load the latest checkpoint under ``root`` if there is one."""
        path = checkpoint.latest(root)
        if path is None:
            return False
        state = checkpoint.load(path, {"params": self.params, "opt": self.opt_state, "meta": {"step": 0}})
        self.step = int(state["meta"]["step"])
        print(f"resumed from {path} at step {self.step}")
        return True

    def sample(self, n_tokens: int, prompt: str, seed: int) -> str:
        if self.tokenizer is None:
            return ""
        ids = torch.tensor([self.tokenizer.encode(prompt)], device=self.device)
        out = generate(lambda p, x: self.model.forward(p, x, self.cfg.model), self.params, ids, n_tokens,
                       self.cfg.train.seq_len, temperature=0.8, top_k=40, seed=seed)
        return self.tokenizer.decode(out[0].tolist())


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    sample: str = ""
    checkpoint: str = ""
    run: Run | None = None


def train(cfg: RunConfig, progress: bool = True) -> RunResult:
    run = Run(cfg)
    t = cfg.train
    if t.load_dir:
        run.resume(t.load_dir)
    flops = model_flops_per_token(run.specs, cfg.model, t.seq_len)
    peak = device_peak(run.device, torch.float32, t.peak_flops)
    print(f"model: {family_name(cfg.model)}, {count_params(run.specs):,} parameters, {flops / 1e6:,.1f} MFLOPs/token; "
          f"device {run.device}; MFU against {peak.flops / 1e12:.3f} TFLOP/s ({peak.source})")
    print(f"batch: {t.global_batch_size} x {t.seq_len} tokens = micro batch {t.micro_batch_size} x "
          f"{cfg.grad_accum_steps()} accumulation steps; {t.steps} steps; compile={t.compile}")
    log = RunLog(t.log_jsonl, t.tensorboard_dir)
    result = RunResult(run=run)
    meter = Throughput(flops, peak)
    tokens_per_step = t.global_batch_size * t.seq_len
    bar = tqdm(total=t.steps, initial=run.step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    first_step = run.step
    while run.step < t.steps:
        t0 = time.perf_counter()
        m = run.do_step()  # float() of the loss waits for the step to finish
        seconds = time.perf_counter() - t0
        step = run.step
        first = step == first_step + 1
        rates = meter.step(0 if first else tokens_per_step, seconds)  # compilation is not throughput
        record = {"step": step, **m, "step_time_s": seconds, **rates}
        result.losses.append(m["loss"])
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            record["valid_loss"] = result.valid_losses[step] = run.evaluate()
            bar.write(f"step {step}: validation loss {record['valid_loss']:.4f}")
        log.write(record)
        bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", gnorm=f"{m['grad_norm']:.2f}",
                        tok_s=f"{rates['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
        if first:
            bar.write(f"step {step}: first step (includes compilation) took {seconds:.1f} s")
            meter.interval()
        elif step % t.log_interval == 0 or step == t.steps:
            avg = meter.interval()
            bar.write(f"step {step:>6} | loss {m['loss']:.4f} | lr {m['lr']:.3e} | grad norm {m['grad_norm']:.3f} | "
                      f"{avg['tokens_per_s']:,.0f} tokens/s | MFU {100 * avg['mfu']:.2f}%")
        if t.save_dir and ((t.save_interval and step % t.save_interval == 0) or step == t.steps):
            result.checkpoint = run.save(t.save_dir)
            bar.write(f"step {step}: saved checkpoint {result.checkpoint}")
    bar.close()
    log.close()
    if t.sample_tokens and run.tokenizer is not None:
        result.sample = run.sample(t.sample_tokens, t.sample_prompt, t.seed)
        print("-" * 30 + " sample " + "-" * 30 + f"\n{result.sample}\n" + "-" * 68)
    return result
