"""How a step computes (``RunConfig.compute``): precision, loss scaling, activation recompute,
kernels and the chunked loss. Here, below the models, so that model code and the forward by
pieces can take it typed; ``fxmega.config`` validates it with the rest of a run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeConfig:
    """How the step computes: precision, activation recompute, kernels (Megatron's mixed
    precision and activation recompute flags)."""

    precision: str = "fp32"  # fp32 | bf16 | fp16: compute dtype; parameters (masters) and AdamW state stay fp32
    grad_reduce: str = "fp32"  # fp32 | bf16: dtype of data-parallel gradient reductions (bf16 halves their bytes)
    loss_scale: float = 0.0  # fp16: a fixed loss scale; 0 scales dynamically (Megatron: --loss-scale)
    initial_loss_scale: float = 2.0**32  # fp16 dynamic scaling (Megatron: --initial-loss-scale)
    min_loss_scale: float = 1.0  # never scale below this (Megatron: --min-loss-scale)
    loss_scale_window: int = 1000  # clean steps before the scale doubles (Megatron: --loss-scale-window)
    hysteresis: int = 2  # overflows tolerated before the scale first halves (Megatron: --hysteresis)
    recompute: str = "none"  # none | selective (keep matmul outputs, redo the rest) | full (redo whole blocks)
    recompute_layers: int = 0  # recompute only the first N blocks; 0: all (Megatron: --recompute-num-layers)
    # off | tensorwise | rowwise: the dense layers' weight matmuls in fp8 through torchao (``fxmega.ops.fp8``)
    fp8: str = "off"
    # ZeRO-3 / fsdp: gather the weights the tensorwise fp8 recipe casts as fp8 bytes with their scales
    # (torchtitan's enable_fsdp_float8_all_gather): a quarter of fp32's gather bytes, half of bf16's
    fp8_gather: bool = False
    kernels: str = "reference"  # reference (compiled PyTorch) | triton (hand-written norms and cross-entropy, CUDA)
    loss_chunk: int = 0  # tokens per cross-entropy chunk: fp32 logits exist for one chunk at a time; 0: whole batch
