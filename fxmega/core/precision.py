"""Mixed precision: fp32 master weights, a low-precision compute copy, fp16 loss scaling.

The parameters a run stores, shards and updates are always fp32 (Megatron's "main params"),
and so are the AdamW moments. The loss function casts them to the compute dtype as it reads
them, inside the compiled step, so autograd hands back fp32 gradients for the masters (the
backward of a cast is a cast back) and gradient accumulation and reduction stay in fp32
unless ``compute.grad_reduce=bf16`` asks for bf16 reductions.

fp16 needs loss scaling: the loss is multiplied by a scale before the backward so that
small gradients do not flush to zero in fp16, and the fp32 gradients are divided by it
again before clipping and the update. ``LossScaler`` is Megatron's dynamic scaler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def cast(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Floating tensors cast to ``dtype`` (differentiably); others and fp32-to-fp32 untouched."""
    if dtype == torch.float32:
        return list(tensors)
    return [t.to(dtype) if t.is_floating_point() else t for t in tensors]


@dataclass
class LossScaler:
    """Megatron's ``DynamicGradScaler``: start at ``initial``; after ``hysteresis`` steps
    whose gradients overflowed (counted since the scale last grew), halve the scale on every
    overflow, never below ``min_scale``; after ``window`` clean steps in a row, double it.
    With ``fixed`` > 0 the scale never changes (Megatron's ``--loss-scale``).

    An overflowed step is not applied (the compiled step drops it); the caller reports it."""

    initial: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    fixed: float = 0.0

    def __post_init__(self) -> None:
        self.scale = self.fixed or self.initial
        self.clean_steps = 0
        self.hysteresis_left = self.hysteresis
        self.overflows = 0

    def update(self, finite: bool) -> None:
        """Account one step: ``finite`` is whether all its gradients were finite."""
        if self.fixed:
            self.overflows += not finite
            return
        if not finite:
            self.overflows += 1
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state.get("overflows", 0))


def scaler_for(compute: object) -> LossScaler | None:
    """The loss scaler a ``ComputeConfig`` asks for: fp16 only (bf16 has fp32's range)."""
    if compute.precision != "fp16":
        return None
    return LossScaler(compute.initial_loss_scale, compute.min_loss_scale, compute.loss_scale_window,
                      compute.hysteresis, compute.loss_scale)
