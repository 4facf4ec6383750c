"""Rotary position embeddings: the frequencies (plain, or scaled for long context the way
Llama 3.1 and YaRN do), the cos/sin tables at given positions, and the rotation.

Tables are built from explicit positions, not from a sequence length, so that a shard of a
sequence (a context-parallel rank's chunks, a decoding step's new tokens) sees its global
positions. The layout is Hugging Face Llama's rotate-half: the first half of each head
pairs with the second half, not even dims with odd ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fxmega.core.errors import ConfigError

SCALINGS = ("none", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are stretched past the context a model was pre-trained on.

    ``llama3`` (Llama 3.1): wavelengths longer than ``original_max_seq_len / low_freq_factor``
    are divided by ``factor``, shorter than ``original_max_seq_len / high_freq_factor`` are
    kept, and those between are interpolated smoothly. ``yarn`` (Peng et al. 2023): a linear
    ramp between interpolated (``/ factor``) and original frequencies over the dims that turn
    between ``beta_slow`` and ``beta_fast`` times within the original context, and the tables
    scaled by ``attention_factor`` (0: YaRN's ``0.1 ln(factor) + 1``)."""

    kind: str = "none"
    factor: float = 1.0
    original_max_seq_len: int = 0  # the pre-training context (both kinds)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 0.0  # yarn; 0 means 0.1 ln(factor) + 1

    def validate(self, prefix: str = "model.rope_scaling") -> None:
        if self.kind not in SCALINGS:
            raise ConfigError(f"{prefix}.kind={self.kind!r}: choose one of {', '.join(SCALINGS)}")
        if self.kind == "none":
            return
        if self.factor < 1:
            raise ConfigError(f"{prefix}.factor={self.factor}: a {self.kind} scaling stretches the context, so "
                              f"factor must be at least 1 (e.g. 8 for Llama 3.1)")
        if self.original_max_seq_len <= 0:
            raise ConfigError(f"{prefix}.original_max_seq_len={self.original_max_seq_len}: give the context the model "
                              f"was pre-trained on (Llama 3.1: 8192)")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"{prefix}: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor} and {self.high_freq_factor} (Llama 3.1: 1 and 4)")
        if self.kind == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ConfigError(f"{prefix}: yarn needs 0 < beta_slow < beta_fast, got {self.beta_slow} and "
                              f"{self.beta_fast} (YaRN: 1 and 32)")


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding: the base ``theta`` and the long-context scaling."""

    theta: float = 10000.0
    scaling: RopeScaling = field(default_factory=RopeScaling)

    def inv_freq(self, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
        """``[head_dim / 2]`` rotation speeds (radians per position), in float32."""
        # the same float32 operations as transformers, so that imported models give its logits
        wave = self.theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        s = self.scaling
        if s.kind == "llama3":
            return _llama3(1.0 / wave, s)
        if s.kind == "yarn":
            return _yarn(wave, s, head_dim, self.theta)
        return 1.0 / wave

    @property
    def attention_factor(self) -> float:
        """What the tables are multiplied by (YaRN's temperature; 1 otherwise)."""
        s = self.scaling
        if s.kind != "yarn":
            return 1.0
        return s.attention_factor or (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)

    def tables(self, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, head_dim]`` at ``positions`` (any integer shape)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq(head_dim, positions.device)
        angles = torch.cat([angles, angles], dim=-1)
        scale = self.attention_factor
        return angles.cos() * scale, angles.sin() * scale


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    long_wave = s.original_max_seq_len / s.low_freq_factor
    short_wave = s.original_max_seq_len / s.high_freq_factor
    scaled = torch.where(wavelen > long_wave, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(between, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def _yarn(wave: torch.Tensor, s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    def dim_turning(turns: float) -> float:  # the dim whose rotation turns ``turns`` times in the context
        return head_dim * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(s.beta_fast)), 0)
    high = min(math.ceil(dim_turning(s.beta_slow)), head_dim - 1)
    high = high if high != low else high + 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, device=wave.device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated (slow dims)
    return 1.0 / (s.factor * wave) * (1 - keep) + 1.0 / wave * keep


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, seq, heads, head_dim]`` by tables ``[seq, head_dim]`` or
    ``[batch, seq, head_dim]``."""
    cos = cos[..., None, :].to(x.dtype)
    sin = sin[..., None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin
