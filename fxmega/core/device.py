"""Which device a process computes on, and deterministic kernels when a run asks for them."""

from __future__ import annotations

import os

import torch

from fxmega.core.errors import ConfigError


def pick_device(name: str) -> torch.device:
    """``train.device``: auto (CUDA when present, else the CPU), cpu or cuda."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available: use train.device=cpu or auto")
    return torch.device(name)


def set_deterministic() -> None:
    """Kernels that give bitwise the same result every run (an error, not a silent
    nondeterministic fallback, where an op has no deterministic version)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first call
    torch.use_deterministic_algorithms(True)
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False


def kernel_cache_name() -> str:
    """A name for inductor's kernel cache that differs between CPU kernel sets: torch 2.13's
    cache does not key its compiled C++ on ``ATEN_CPU_CAPABILITY``, and kernels cached under
    one capability, loaded under another, were measured to read garbage (NaN losses, indices
    out of range) on an AVX-512 machine switched to ``avx2``."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "native") or "native"
