"""Config checks every model family makes, with messages that name the key and the fix."""

from __future__ import annotations

from fxmega.core.errors import ConfigError


def require_positive(cfg: object, names: tuple[str, ...], prefix: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{prefix}.{name}={getattr(cfg, name)} must be positive")


def require_heads_divide(d_model: int, n_heads: int, prefix: str) -> None:
    if d_model % n_heads:
        divisors = [h for h in range(1, d_model + 1) if d_model % h == 0 and h <= 64]
        raise ConfigError(f"{prefix}.n_heads={n_heads} does not divide {prefix}.d_model={d_model}: "
                          f"choose n_heads among {divisors} or change d_model")
