"""Blending datasets by weight (Megatron-LM's ``--data-path 0.7 A 0.3 B``).

Each dataset gets its exact share of the blend (largest-remainder rounding of
``weight * size``), and its samples are interleaved as evenly as possible: the k-th sample
of dataset d is placed at the ideal time ``(k + 0.5) / weight_d`` and all samples are
sorted by time. Every prefix of the blend therefore holds each dataset within one sample
of its weight — the property Megatron-LM's greedy C++ helper has — with one vectorised sort.
"""

from __future__ import annotations

import numpy as np

from fxmega.core.errors import ConfigError


def parse_data_path(value: str | list | tuple) -> list[tuple[float, str]]:
    """``"A"`` or ``"0.7 A 0.3 B"`` (or the list argparse gives) → [(weight, prefix)] with
    the weights normalised to sum to one."""
    parts = value.split() if isinstance(value, str) else [str(v) for v in value]
    if not parts:
        raise ConfigError("data.source is empty: give a dataset prefix, or weights and prefixes like 0.7 A 0.3 B")
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if len(parts) % 2:
        raise ConfigError(f"data path {' '.join(parts)!r} has {len(parts)} words: a blend alternates weight and "
                          f"prefix, like 0.7 A 0.3 B")
    pairs = []
    for w, prefix in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"data path weight {w!r} (before {prefix!r}) is not a number; a blend alternates "
                              f"weight and prefix, like 0.7 A 0.3 B") from None
        if not weight > 0:
            raise ConfigError(f"data path weight {w} for {prefix!r} must be positive")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def blend_counts(weights: list[float], size: int) -> np.ndarray:
    """Samples per dataset: ``weight * size`` rounded so the counts sum to ``size``."""
    raw = np.asarray(weights, dtype=np.float64) * size
    counts = np.floor(raw).astype(np.int64)
    remainder = size - int(counts.sum())
    counts[np.argsort(-(raw - counts), kind="stable")[:remainder]] += 1
    return counts


def blend_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample, which dataset it comes from and its index there."""
    counts = blend_counts(weights, size)
    times = np.concatenate([(np.arange(n) + 0.5) / w for n, w in zip(counts, weights)])
    dataset = np.concatenate([np.full(n, d, dtype=np.int64) for d, n in enumerate(counts)])
    within = np.concatenate([np.arange(n, dtype=np.int64) for n in counts])
    order = np.argsort(times, kind="stable")
    return dataset[order], within[order]


class BlendedDataset:
    """``size`` samples drawn from several datasets in the given proportions."""

    def __init__(self, datasets: list, weights: list[float], size: int) -> None:
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = blend_index(weights, size)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
