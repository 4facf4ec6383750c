"""A training run's state: what it carries from one step to the next and what a checkpoint
saves and restores — this rank's parameters and AdamW state, the step counters and the fp16
loss scaler. Plain data: the machinery that changes it (the compiled steps, the data, the
checkpointer) lives in ``fxmega.training.run``."""

from __future__ import annotations

from dataclasses import dataclass

from fxmega.core.precision import LossScaler


@dataclass
class TrainState:
    params: dict  # this rank's parameters (all of them, or its shards and pipeline stages)
    opt_state: dict  # AdamW: step, exp_avg, exp_avg_sq (per local parameter, in leaf order)
    step: int = 0  # optimizer steps taken
    skipped_steps: int = 0  # of them, steps whose update was dropped (non-finite, fp16 overflow)
    scaler: LossScaler | None = None  # fp16's dynamic loss scale; None otherwise
