"""Learning-rate schedules as plain functions of the step.

``step`` counts optimizer steps from 0. Warmup rises linearly as ``lr * (step + 1) /
warmup_steps`` and reaches ``lr`` on its last step, so the first step already moves
(Megatron's warmup starts at 0 and spends a step doing nothing). After warmup each schedule
goes from ``lr`` to ``min_lr``.
"""

from __future__ import annotations

import math

from fxmega.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) in a run of ``total_steps``."""
    lr, min_lr, warmup = optim.lr, optim.min_lr, optim.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if optim.schedule == "constant":
        return lr
    if optim.schedule == "inverse-sqrt":
        # lr at the end of warmup, then proportional to 1/sqrt(step) (T5, fairseq).
        return max(min_lr, lr * math.sqrt(max(warmup, 1) / (step + 1)))
    if optim.schedule == "wsd":
        # warmup, a long stable phase at lr, then a short decay to min_lr at the end.
        decay = optim.wsd_decay_steps or max(1, round(0.2 * total_steps))
        start = total_steps - decay
        if step < start:
            return lr
        frac = min(1.0, (step - start + 1) / decay)
        if optim.wsd_decay_style == "linear":
            shape = 1 - frac
        elif optim.wsd_decay_style == "cosine":
            shape = 0.5 * (1 + math.cos(math.pi * frac))
        else:  # "1-sqrt", from the MiniCPM/WSD papers
            shape = 1 - math.sqrt(frac)
        return min_lr + (lr - min_lr) * shape
    decay_steps = optim.decay_steps or max(1, total_steps - warmup)
    frac = min(1.0, (step - warmup) / decay_steps)
    if optim.schedule == "linear":
        return lr - (lr - min_lr) * frac
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * frac))  # cosine
