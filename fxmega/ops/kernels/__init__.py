"""Which implementation the model's norms and cross-entropy use.

``reference``: PyTorch ops, which torch.compile fuses (C++ on CPU, Triton on GPU).
``triton``: fxmega's hand-written Triton kernels (``fxmega.ops.kernels.triton_ops``), registered
as ``torch.library`` custom ops so they sit inside compiled graphs as single calls.

The choice is made around a traced function (``with kernels.use("triton"): ...``) rather
than passed down: model code stays free of execution details, the way ``fxmega.sharding``'s
``layout.activate`` keeps sharding out of it. Dynamo reads the choice while tracing, so a
compiled step bakes in the kernels that were active when it was traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fxmega.core.errors import ConfigError

_active = "reference"


def active() -> str:
    return _active


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run the block with the ``reference`` or ``triton`` kernels."""
    global _active
    previous, _active = _active, name
    try:
        yield
    finally:
        _active = previous


def check_available(name: str, device: torch.device) -> None:
    """Fail loudly (no silent fallback) when ``name`` cannot run on ``device``."""
    if name != "triton":
        return
    from fxmega.ops.kernels import triton_ops  # imports triton when installed

    if not triton_ops.AVAILABLE:
        raise ConfigError("compute.kernels=triton needs the triton package: pip install -e '.[triton]' "
                          "(or set compute.kernels=reference)")
    if device.type != "cuda" and not triton_ops.INTERPRETED:
        raise ConfigError(f"compute.kernels=triton runs on CUDA devices; this run is on {device.type} "
                          f"(TRITON_INTERPRET=1 runs the kernels in Triton's interpreter, for tests): "
                          f"set compute.kernels=reference")


def _on_local(fn: Any, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
    """Run a row-wise kernel on a DTensor's local rows: a norm over the last dim needs no
    communication whatever the leading dims' placement (the last dim is never split)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return fn(x, *[p.to_local() if isinstance(p, DTensor) else p for p in params])
    local = fn(x.to_local(), *[p.full_tensor() if isinstance(p, DTensor) else p for p in params])
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    from fxmega.ops.kernels import triton_ops

    return _on_local(lambda t, s: triton_ops.rms_norm(t, s, eps), x, scale)


def layer_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    from fxmega.ops.kernels import triton_ops

    return _on_local(lambda t, s, b: triton_ops.layer_norm(t, s, b, eps), x, scale, bias)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor,
                       vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from fxmega.ops.kernels import triton_ops

    return triton_ops.cross_entropy_rows(logits, targets, vocab_size)
