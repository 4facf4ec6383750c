"""Normal numbers addressed by position: value ``i`` of a parameter is a pure function of the
parameter's key and ``i``, so any shard of a tensor can be drawn on its own, on its own
device, and equals the slice of the whole tensor drawn anywhere else (JAX's counter-based
``random.normal`` gives sharded init the same way).

A counter-based generator: each element's two 24-bit uniforms are the SplitMix64 outputs at
counters ``2i`` and ``2i+1`` of the key's stream; Box-Muller turns them into one normal. The
logarithm and cosine are written with +, -, *, / and ``frexp`` only (series that reach
float32 precision), because those are correctly rounded by IEEE 754 everywhere — whereas
``torch.log``/``torch.cos`` may differ in the last bit between a vectorised loop and its
scalar tail, or between CPU and CUDA. So the values are bit-identical whatever the shard,
the tensor's alignment or the device (CUDA against the CPU: compared by ``bench/gpu.sh``).
"""

from __future__ import annotations

import math

import torch

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function of a counter state (int64, wrapping arithmetic)."""
    x = x ^ _shift_right(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shift_right(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def uniform24(key: int, counter: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) with 24 random bits (as ``torch.rand``'s float32): the key's
    stream at ``counter`` (int64)."""
    state = counter * _signed(_GAMMA) + _signed(key + _GAMMA)
    return _shift_right(splitmix64(state), 40).to(torch.float32) * 2.0**-24


_LN2 = 0.6931471805599453


def _log(u: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float32 ``u``: ``u = m 2^e`` with m in [1/sqrt2, sqrt2), then
    ``log m = 2 atanh(s)``, ``s = (m-1)/(m+1)``, |s| < 0.172: 6 terms reach float32's
    precision."""
    m, e = torch.frexp(u)  # m in [0.5, 1)
    low = m < 1 / math.sqrt(2)
    m = torch.where(low, m * 2, m)
    e = (e - low.to(e.dtype)).to(u.dtype)
    s = (m - 1) / (m + 1)
    s2 = s * s
    series = torch.full_like(s, 1.0 / 13)
    for k in range(5, -1, -1):  # Horner over 1/(2k+1)
        series.mul_(s2).add_(1.0 / (2 * k + 1))
    return e.mul_(_LN2).add_(series.mul_(s).mul_(2))


def _cos_turns(v: torch.Tensor) -> torch.Tensor:
    """cos(2 pi v) for v in [0, 1): the quadrant, then Taylor series on [0, pi/2) (to x^16:
    error below 1e-9)."""
    w = v * 4
    quadrant = torch.floor(w)
    x = (w - quadrant).mul_(math.pi / 2)
    x2 = x * x
    cos, sin = torch.ones_like(x), torch.ones_like(x)
    for n in range(16, 0, -2):  # cos = 1 - x^2/2! + ...; sin = x (1 - x^2/3! + ...)
        cos = cos.mul_(x2).mul_(-1.0 / (n * (n - 1))).add_(1)
        sin = sin.mul_(x2).mul_(-1.0 / ((n + 1) * n)).add_(1)
    sin.mul_(x)
    q = quadrant.to(torch.int64)
    return torch.where(q == 0, cos, torch.where(q == 1, -sin, torch.where(q == 2, -cos, sin)))


def normal_at(key: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal float32 values at element positions ``index`` (int64, any shape) of
    the key's tensor."""
    u1 = 1.0 - uniform24(key, 2 * index)  # (0, 1]: a finite log
    u2 = uniform24(key, 2 * index + 1)
    return torch.sqrt(_log(u1).mul_(-2.0)).mul_(_cos_turns(u2))
