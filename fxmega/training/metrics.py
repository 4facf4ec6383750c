"""Throughput accounting: FLOPs per token, the device's peak, and model FLOPs utilisation.

FLOPs per token follow PaLM (appendix B) and nanoGPT: ``6 N + 12 L H Q T`` for a forward
and backward pass, where N counts parameters without the learned position table (a table
lookup does no multiplies), L is the number of layers, H·Q the attention width (heads ×
head size) and T the sequence length. For GPT-2 124M at T=1024 that is 855,166,464.

MFU divides achieved model FLOP/s by a peak that is either known for the device (GPU data
sheets, dense tensor-core numbers) or measured here with a large matrix product — and says
which, so it is never silently wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fxmega.core import tree
from fxmega.core.spec import ParamSpec
from fxmega.models import model_for


def flops_per_token(specs: tree.Tree, n_layers: int, attention_width: float, seq_len: int,
                    expert_fraction: float = 1.0) -> int:
    """``6 N + 12 L H Q T`` (Megatron-LM / PaLM): ``N`` the parameters a token passes through
    (no position table; of experts stacked along ``expert``, the ``expert_fraction`` a token
    is routed to), ``L`` layers, ``H Q`` the attention width, ``T`` the sequence."""
    n = 0.0
    for s in tree.leaves(specs):
        if isinstance(s, ParamSpec) and s.axes[0] != "position":
            n += s.numel * (expert_fraction if s.axes[0] == "expert" else 1.0)
    return round(6 * n + 12 * n_layers * attention_width * seq_len)


def model_flops_per_token(specs: tree.Tree, model_cfg: object, seq_len: int) -> int:
    """``flops_per_token`` for a model config; a mixture of experts counts the ``top_k`` of
    ``n_experts`` each token is routed to."""
    moe = model_for(model_cfg).experts(model_cfg)
    fraction = moe.top_k / moe.n_experts if moe is not None else 1.0
    return flops_per_token(specs, model_cfg.n_layers, model_cfg.n_heads * model_cfg.head_dim, seq_len, fraction)


# Dense peak FLOP/s from NVIDIA's data sheets (SXM parts; no sparsity).
_KNOWN_GPU_PEAKS = {
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},  # fp32 via TF32
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 494.7e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
}


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    source: str  # how the number was obtained, printed beside MFU


def known_peak(device: torch.device, dtype: torch.dtype) -> Peak | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in _KNOWN_GPU_PEAKS.items():
        if key in name and dtype in table:
            if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
                return None  # true fp32 runs far below the TF32 tensor-core number
            return Peak(table[dtype], f"{name} data sheet, {str(dtype).removeprefix('torch.')}")
    return None


def measure_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 1.0) -> Peak:
    """Achievable matrix-multiply FLOP/s here: the best of repeated ``size``³ products."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    torch.mm(a, b)  # warm up
    while time.perf_counter() < deadline or best == 0.0:
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return Peak(best, f"measured {size}x{size} {str(dtype).removeprefix('torch.')} matmul on {device.type}")


def device_peak(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> Peak:
    if override > 0:
        return Peak(override, "given by train.peak_flops")
    return known_peak(device, dtype) or measure_peak(device, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Throughput:
    """Tokens/s and MFU per step, and averaged over the steps since the last ``interval()``."""

    def __init__(self, flops_per_token: int, peak: Peak, n_devices: int = 1) -> None:
        self.flops_per_token, self.peak, self.n_devices = flops_per_token, peak, n_devices
        self._tokens = 0
        self._seconds = 0.0

    def _rates(self, tokens: float, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / max(seconds, 1e-9)
        return {"tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * self.flops_per_token / (self.peak.flops * self.n_devices)}

    def step(self, tokens: int, seconds: float) -> dict[str, float]:
        """Record one step; returns its own rates."""
        self._tokens += tokens
        self._seconds += seconds
        return self._rates(tokens, seconds)

    def interval(self) -> dict[str, float]:
        """Rates over the steps recorded since the last call."""
        rates = self._rates(self._tokens, self._seconds)
        self._tokens, self._seconds = 0, 0.0
        return rates
