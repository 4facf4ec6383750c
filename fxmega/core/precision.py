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

    The state lives on ``device`` and ``update`` decides from the step's finite flag there,
    so the next step's scale is known without reading anything back to the host (no sync
    per step). ``scale``, ``clean_steps``, ``hysteresis_left`` and ``overflows`` read it
    (a sync: for logs, checkpoints and tests). An overflowed step is not applied (the
    compiled step drops it); the caller reports it."""

    initial: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    fixed: float = 0.0
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        self.load_state_dict({"scale": self.fixed or self.initial, "clean_steps": 0,
                              "hysteresis_left": self.hysteresis, "overflows": 0})

    def update(self, finite: torch.Tensor | bool) -> None:
        """Account one step: ``finite`` (a bool tensor on the device, or a bool) is whether
        all its gradients were finite. New tensors, not in-place writes: a scale handed to a
        step stays what that step ran with."""
        overflow = ~torch.as_tensor(finite, device=self.device)
        self.overflow_count = self.overflow_count + overflow.long()
        if self.fixed:
            return
        hysteresis_left = self.hysteresis_tensor - overflow.long()
        clean = torch.where(overflow, 0, self.clean_tensor + 1)
        halved = torch.clamp(self.scale_tensor / 2, min=self.min_scale)
        scale = torch.where(overflow & (hysteresis_left <= 0), halved, self.scale_tensor)
        grow = clean == self.window  # never on an overflow: clean is 0 there
        self.scale_tensor = torch.where(grow, scale * 2, scale)
        self.clean_tensor = torch.where(grow, 0, clean)
        self.hysteresis_tensor = torch.where(grow, self.hysteresis, hysteresis_left)

    @property
    def scale(self) -> float:
        return float(self.scale_tensor)

    @property
    def clean_steps(self) -> int:
        return int(self.clean_tensor)

    @property
    def hysteresis_left(self) -> int:
        return int(self.hysteresis_tensor)

    @property
    def overflows(self) -> int:
        return int(self.overflow_count)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left,
                "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        def on_device(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(value, dtype=dtype, device=self.device)
        self.scale_tensor = on_device(float(state["scale"]), torch.float32)  # powers of 2: exact in fp32
        self.clean_tensor = on_device(int(state["clean_steps"]), torch.int64)
        self.hysteresis_tensor = on_device(int(state["hysteresis_left"]), torch.int64)
        self.overflow_count = on_device(int(state.get("overflows", 0)), torch.int64)


def scaler_for(compute: object, device: torch.device | str = "cpu") -> LossScaler | None:
    """The loss scaler a ``ComputeConfig`` asks for, on ``device``: fp16 only (bf16 has
    fp32's range)."""
    if compute.precision != "fp16":
        return None
    return LossScaler(compute.initial_loss_scale, compute.min_loss_scale, compute.loss_scale_window,
                      compute.hysteresis, compute.loss_scale, device)
