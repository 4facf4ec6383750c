"""Global batches for a step, and their split into micro batches.

Batches are a pure function of (seed, split, step): resuming at step N reads exactly the
batches an uninterrupted run reads, with no loader state to save. Each sample is a window
of ``seq_len + 1`` tokens: ``inputs`` are its first ``seq_len``, ``targets`` its last.

The sources here also read any rows of a global batch alone (``batch_rows``), equal to those
rows of ``global_batch``: a data-parallel rank reads only its own micro batches' windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fxmega.core.errors import DataError

_SPLIT_IDS = {"train": 0, "valid": 1}


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_IDS[split], step])


def _as_batch(windows: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(windows.astype(np.int64))
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


class TokenWindows:
    """Random windows of a 1-D token array (a tokenized corpus held in memory or mapped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, split: str) -> None:
        if len(tokens) < seq_len + 2:
            raise DataError(
                f"the {split} split has {len(tokens)} tokens, fewer than one sequence of "
                f"seq_len+1={seq_len + 1}: use a larger corpus or a shorter train.seq_len"
            )
        self.tokens, self.seq_len, self.seed, self.split = tokens, seq_len, seed, split

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return self.batch_rows(step, batch_size, range(batch_size))

    def batch_rows(self, step: int, batch_size: int, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of step ``step``'s global batch of ``batch_size``: every start is
        drawn (a few integers), only these windows are read."""
        starts = _rng(self.seed, self.split, step).integers(0, len(self.tokens) - self.seq_len - 1, size=batch_size)
        windows = np.stack([self.tokens[starts[r]:starts[r] + self.seq_len + 1] for r in rows])
        return _as_batch(windows)


class MockTokens:
    """Deterministic synthetic sequences for tests and benchmarks, with no corpus.

    Each sequence counts up from a random start by a random stride (mod the vocabulary),
    so a model can learn them and the loss visibly falls.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, split: str) -> None:
        self.vocab_size, self.seq_len, self.seed, self.split = vocab_size, seq_len, seed, split

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return self.batch_rows(step, batch_size, range(batch_size))

    def batch_rows(self, step: int, batch_size: int, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of step ``step``'s global batch of ``batch_size``."""
        rng = _rng(self.seed, self.split, step)
        start = rng.integers(0, self.vocab_size, size=(batch_size, 1))
        stride = rng.integers(1, 8, size=(batch_size, 1))
        picked = np.asarray(list(rows), dtype=np.int64)
        windows = (start[picked] + stride[picked] * np.arange(self.seq_len + 1)) % self.vocab_size
        return _as_batch(windows)


def my_rows(batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
    """The rows of a global batch that data-parallel rank ``dp_rank`` reads, in order, in
    Megatron's layout: the global batch is a sequence of accumulation steps, each holding one
    micro batch per data-parallel rank."""
    per_step = micro_batch_size * dp_size
    if batch_size % per_step:
        raise DataError(f"a global batch of {batch_size} sequences does not split into micro batches of "
                        f"{micro_batch_size} over {dp_size} data-parallel ranks")
    return [start + dp_rank * micro_batch_size + i for start in range(0, batch_size, per_step)
            for i in range(micro_batch_size)]


def micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int, dp_rank: int = 0,
                  dp_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro batches of a global batch, in Megatron's order: the
    global batch is a sequence of accumulation steps, each holding one micro batch per
    data-parallel rank. Every mesh therefore sees the same samples in the same steps."""
    rows = my_rows(next(iter(batch.values())).shape[0], micro_batch_size, dp_rank, dp_size)
    return [{k: v[rows[lo]:rows[lo] + micro_batch_size] for k, v in batch.items()}
            for lo in range(0, len(rows), micro_batch_size)]


class SampleBatches:
    """Global batches from a dataset of samples (``GPTDataset``, ``BlendedDataset``): step
    ``s`` takes samples ``[s*B, (s+1)*B)``, so the data position is the step, as in
    Megatron-LM (consumed samples = step x global batch). Token ids are checked against
    the model's vocabulary as they are read."""

    def __init__(self, dataset, vocab_size: int, name: str) -> None:
        self.dataset, self.vocab_size, self.name = dataset, vocab_size, name

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return self.batch_rows(step, batch_size, range(batch_size))

    def batch_rows(self, step: int, batch_size: int, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of step ``step``'s global batch of ``batch_size``: only their samples are read."""
        lo, hi = step * batch_size, (step + 1) * batch_size
        if hi > len(self.dataset):
            raise DataError(f"the {self.name} data holds {len(self.dataset):,} samples; step {step} needs samples "
                            f"up to {hi:,} (the index is built for the configured steps; rebuild it for more)")
        windows = np.stack([self.dataset[lo + r] for r in rows])
        top = int(windows.max())
        if top >= self.vocab_size or int(windows.min()) < 0:
            raise DataError(f"token id {top} in the {self.name} data is outside model.vocab_size={self.vocab_size}: "
                            f"the data was tokenized with a larger vocabulary than the model's; match "
                            f"data.tokenizer to the data, or raise model.vocab_size")
        return _as_batch(windows)


def epoch_rows(n: int, step: int, batch_size: int, seed: int, stream: int) -> list[int]:
    """The sample indices of step ``step``'s global batch over ``n`` samples: each epoch visits
    every sample once, in an order drawn from ``(seed, stream, epoch)``."""
    start, rows = step * batch_size, []
    while len(rows) < batch_size:
        epoch, offset = divmod(start + len(rows), n)
        order = np.random.default_rng([seed, stream, epoch]).permutation(n)
        rows += order[offset:offset + batch_size - len(rows)].tolist()
    return rows
