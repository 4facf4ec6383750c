"""GPT samples from an indexed dataset, the way Megatron-LM's GPTDataset makes them.

The documents of a split are concatenated, in a shuffled order per epoch, into one token
stream; sample ``i`` is the window ``[i*seq_len, i*seq_len + seq_len + 1)`` of that stream
(so samples share their boundary token, and a sample may span documents); the samples are
then visited in a shuffled order. Three numpy arrays describe it all:

- ``order``:   the sequence ids of the split, epoch after epoch, each epoch shuffled;
- ``starts``:  for each sample, (position in ``order``, token offset in that sequence);
- ``shuffle``: the order in which samples are visited (shuffled within each epoch).

Megatron-LM builds ``starts`` with a C++ loop; here it is one ``searchsorted`` over the
cumulative lengths (10 million documents index in seconds, see bench/data.py). The arrays
are cached on disk under a name hashed from everything they depend on, written atomically,
so ranks and restarts share them.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxmega.core.errors import ConfigError, DataError
from fxmega.data.indexed import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split 949,50,1``: weights of train, valid and test, normalised."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data.split={split!r} is not a list of numbers; write it like 949,50,1") from None
    parts = (parts + [0.0, 0.0])[:3]
    if len(str(split).split(",")) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data.split={split!r} needs up to three non-negative weights with a positive sum, "
                          f"like 949,50,1 (train, valid, test)")
    total = sum(parts)
    return tuple(p / total for p in parts)  # type: ignore[return-value]


def split_bounds(n_documents: int, split: tuple[float, float, float]) -> list[tuple[int, int]]:
    """Document ranges of train, valid and test, as Megatron-LM computes them: cumulative
    rounded fractions of the document count, corrected so they end at the count."""
    edges = [0]
    for frac in split:
        edges.append(edges[-1] + int(round(frac * float(n_documents))))
    diff = edges[-1] - n_documents
    edges = [edges[0]] + [e - diff for e in edges[1:]]
    return [(edges[i], edges[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class SampleIndex:
    order: np.ndarray  # int64 sequence ids
    starts: np.ndarray  # int64 [n_samples + 1, 2]: (position in order, offset)
    shuffle: np.ndarray  # int64 permutation of range(n_samples)


def build_sample_index(lengths: np.ndarray, sequence_ids: np.ndarray, seq_len: int, num_samples: int,
                       seed: int) -> SampleIndex:
    """The index for at least ``num_samples`` samples of ``seq_len + 1`` tokens over the
    given sequences (with their token ``lengths``), as many epochs as that takes.

    Each epoch's document order and its samples' visiting order are drawn from their own
    generator, seeded by (seed, epoch); the samples of an epoch are those that start in it.
    So the first N samples do not depend on ``num_samples``: training longer (a larger
    ``--train-iters`` on resume) continues the same order, where Megatron-LM reshuffles."""
    tokens_per_epoch = int(lengths[sequence_ids].sum(dtype=np.int64))
    if tokens_per_epoch < seq_len + 1:
        raise DataError(f"the split holds {tokens_per_epoch:,} tokens, fewer than one sample of seq_len+1="
                        f"{seq_len + 1}: use more data, a different --split or a shorter sequence length")
    # samples starting in epoch e: positions k*seq_len in [e*T, (e+1)*T)
    first_of_epoch = lambda e: -(-e * tokens_per_epoch // seq_len)  # noqa: E731
    epochs = max(1, -(-num_samples * seq_len // tokens_per_epoch))
    while first_of_epoch(epochs) < num_samples:
        epochs += 1
    # one epoch more of stream, so the last exposed samples can run past their epoch's end
    order = np.concatenate([np.random.default_rng([seed, e, 0]).permutation(sequence_ids)
                            for e in range(epochs + 1)]).astype(np.int64)
    ends = np.cumsum(lengths[order], dtype=np.int64)  # token position where each sequence ends
    n_samples = first_of_epoch(epochs)
    positions = np.arange(n_samples + 1, dtype=np.int64) * seq_len
    where = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[where] - lengths[order[where]])
    starts = np.stack([where, offsets], axis=1)
    shuffle = np.concatenate([first_of_epoch(e) + np.random.default_rng([seed, e, 1]).permutation(
        first_of_epoch(e + 1) - first_of_epoch(e)) for e in range(epochs)]).astype(np.int64)
    return SampleIndex(order, starts, shuffle)


class GPTDataset:
    """Samples of ``seq_len + 1`` tokens from one split of an indexed dataset."""

    def __init__(self, dataset: IndexedDataset, split: str, split_weights: tuple[float, float, float], seq_len: int,
                 num_samples: int, seed: int, cache_dir: str | Path | None = None) -> None:
        self.dataset, self.split, self.seq_len = dataset, split, seq_len
        lo, hi = split_bounds(dataset.n_documents, split_weights)[SPLIT_NAMES.index(split)]
        if hi <= lo:
            raise DataError(f"the {split} split of {dataset.prefix} has no documents ({dataset.n_documents:,} "
                            f"documents, split {split_weights}): give it a weight in --split or use more data")
        docs = dataset.document_indices
        sequence_ids = np.arange(docs[lo], docs[hi], dtype=np.int64)
        self.description = {
            "class": "GPTDataset", "prefix": str(Path(dataset.prefix).resolve()), "split": split,
            "documents": [int(lo), int(hi)], "sequences": len(dataset), "tokens": dataset.n_tokens,
            "seq_len": seq_len, "num_samples": num_samples, "seed": seed, "version": 1,
        }
        self.index = _cached(self.description, cache_dir or f"{dataset.prefix}_cache",
                             lambda: build_sample_index(dataset.sequence_lengths.astype(np.int64), sequence_ids,
                                                        seq_len, num_samples, seed))

    def __len__(self) -> int:
        return len(self.index.shuffle)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.index.shuffle[i])
        pos, offset = (int(x) for x in self.index.starts[j])
        need, pieces = self.seq_len + 1, []
        while need > 0:
            seq = int(self.index.order[pos])
            piece = self.dataset.get(seq, offset, min(need, int(self.dataset.sequence_lengths[seq]) - offset))
            pieces.append(piece)
            need -= len(piece)
            pos, offset = pos + 1, 0
        return np.concatenate(pieces).astype(np.int64)


def _read_index(path: Path) -> SampleIndex:
    """A cached sample index; one that is unreadable or lacks an array is a DataError (no
    silent rebuild: something overwrote a file this code wrote atomically)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = [np.asarray(z[k]) for k in ("order", "starts", "shuffle")]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"the cached sample index {path} is unreadable ({type(e).__name__}: {e}); delete it and "
                        f"the run builds it again") from None
    order, starts, shuffle = arrays
    shapes_ok = order.ndim == 1 and shuffle.ndim == 1 and starts.ndim == 2 and starts.shape[1] == 2
    if not shapes_ok or any(a.dtype.kind not in "iu" for a in arrays):
        raise DataError(f"the cached sample index {path} does not hold integer arrays order [n], starts [n + 1, 2] "
                        f"and shuffle [n]; delete it and the run builds it again")
    return SampleIndex(*arrays)


def _cached(description: dict, cache_dir: str | Path, build) -> SampleIndex:
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{key}-{description['split']}-index.npz"
    if path.is_file():
        return _read_index(path)
    index = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")  # every rank may build it; the renames are atomic
    np.savez(tmp, order=index.order, starts=index.starts, shuffle=index.shuffle)
    about = path.parent / f"{key}-{description['split']}-index.json"  # what the arrays were built from
    about_tmp = about.with_suffix(f".{os.getpid()}.tmp")
    about_tmp.write_text(json.dumps(description, indent=1))
    os.replace(about_tmp, about)
    os.replace(tmp, path)
    return index
