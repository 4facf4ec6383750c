"""``run.py eval``: loss and perplexity of a checkpoint on held-out data, on any mesh.

The checkpoint's parameters are loaded onto this run's mesh (resharded as needed, as any
``--load``), and the mean next-token loss is taken over ``train.eval_iters`` global batches
of the validation split — the same sequences whatever the mesh. Perplexity is
``exp(mean loss)`` over those tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxmega.config import RunConfig
from fxmega.errors import ConfigError
from fxmega.train import Run


def evaluate_checkpoint(cfg: RunConfig, parallel: Any = None, device: torch.device | None = None) -> dict[str, Any]:
    """Load ``cfg.train.load_dir`` and evaluate it; returns loss, perplexity and token count
    (every rank takes part; every rank gets the same numbers)."""

    t = cfg.train
    if not t.load_dir:
        raise ConfigError("eval needs a checkpoint: --load CKPT (a checkpoint root or one step directory)")
    run = Run(cfg, parallel, device)
    if not run.resume(t.load_dir, params_only=True):
        raise ConfigError(f"--load {t.load_dir}: no checkpoint there")
    loss = run.evaluate()
    tokens = t.eval_iters * t.global_batch_size * t.seq_len
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "checkpoint": t.load_dir,
            "data": run.data.description}


def report(result: dict[str, Any]) -> str:
    return (f"eval: {result['checkpoint']} on {result['data']} ({result['tokens']:,} tokens): "
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}")
