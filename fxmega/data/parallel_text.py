"""Parallel text: source→target pairs, read from JSON lines of ``{"src": ..., "tgt": ...}``
or from two aligned text files (``SRC.txt,TGT.txt``, one pair per line), and made into
encoder–decoder batches (``fxmega.models.t5``'s stream: the source padded to
``encoder_seq_len``, the target to ``decoder_seq_len``, each ending in EOS, longer ones cut
with their EOS kept).

Batches are a pure function of (seed, split, step): each epoch visits every pair once in an
order drawn from the seed, so any mesh and a resumed run read the same pairs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxmega.core.errors import DataError
from fxmega.data.batches import epoch_rows

_SPLIT_IDS = {"train": 30, "valid": 31}


def read_pairs(spec: str | Path) -> list[tuple[str, str]]:
    """The pairs of a JSON-lines file, or of ``SRC,TGT`` aligned text files."""
    spec = str(spec)
    if "," in spec and not Path(spec).is_file():
        src_path, tgt_path = spec.split(",", 1)
        try:
            src, tgt = (Path(p).read_text(encoding="utf-8").splitlines() for p in (src_path, tgt_path))
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read the aligned text files {spec!r}: {e}") from None
        if len(src) != len(tgt):
            raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: aligned files hold one "
                            f"pair per line")
        return list(zip(src, tgt))
    pairs = []
    try:
        lines = Path(spec).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read parallel text {spec!r}: {e} (give a .jsonl of {{\"src\", \"tgt\"}} or "
                        f"SRC.txt,TGT.txt)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append((str(row["src"]), str(row["tgt"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{spec}:{n}: expected a JSON object with \"src\" and \"tgt\", got {line[:80]!r}") from None
    if not pairs:
        raise DataError(f"{spec} holds no pairs")
    return pairs


def hash_fraction(text: str) -> float:
    """A number in [0, 1) fixed by ``text``: splits that do not depend on the order of the pairs."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32


def split_by_hash(key: str, valid: float = 0.05, test: float = 0.05) -> str:
    """``train``, ``valid`` or ``test`` for a sample, by ``hash_fraction`` of its ``key``: the
    same split whatever the order of the samples or the machine."""
    x = hash_fraction(key)
    return "train" if x < 1 - valid - test else "valid" if x < 1 - test else "test"


def encode_pairs(pairs: list[tuple[str, str]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    return [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]


def fit(ids: list[int], length: int, eos: int) -> list[int]:
    """``ids`` then EOS, cut to ``length`` with the EOS kept."""
    return ids[:length - 1] + [eos]


def stream_batch(pairs: list[tuple[Sequence[int], Sequence[int]]], encoder_seq_len: int, decoder_seq_len: int,
                 pad: int) -> dict[str, torch.Tensor]:
    """The batch ``fxmega.models.t5``'s stream reads of (source, target) ids that fit their
    lengths: ``inputs`` and ``targets`` right-padded, ``decoder_inputs`` (the targets shifted
    right behind the start token, pad), ``loss_mask`` (the real targets) and ``attention_mask``
    (the real tokens of source and target side by side)."""
    b = len(pairs)
    inputs = np.full((b, encoder_seq_len), pad, dtype=np.int64)
    targets = np.full((b, decoder_seq_len), pad, dtype=np.int64)
    real = np.zeros((b, encoder_seq_len + decoder_seq_len), dtype=np.int64)
    for i, (src, tgt) in enumerate(pairs):
        inputs[i, :len(src)], targets[i, :len(tgt)] = src, tgt
        real[i, :len(src)] = 1
        real[i, encoder_seq_len:encoder_seq_len + len(tgt)] = 1
    decoder_inputs = np.concatenate([np.full((b, 1), pad), targets[:, :-1]], axis=1)
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return {"inputs": as_tensor(inputs), "decoder_inputs": as_tensor(decoder_inputs), "targets": as_tensor(targets),
            "loss_mask": as_tensor(real[:, encoder_seq_len:]).float(), "attention_mask": as_tensor(real)}


def seq2seq_batch(pairs: list[tuple[list[int], list[int]]], encoder_seq_len: int, decoder_seq_len: int, pad: int,
                  eos: int) -> dict[str, torch.Tensor]:
    """The encoder–decoder batch of token pairs, each side ended with EOS and cut to fit."""
    return stream_batch([(fit(s, encoder_seq_len, eos), fit(t, decoder_seq_len, eos)) for s, t in pairs],
                        encoder_seq_len, decoder_seq_len, pad)


class PairBatches:
    """Global batches of encoder–decoder pairs, epoch after epoch in seeded orders."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], encoder_seq_len: int, decoder_seq_len: int,
                 pad: int, eos: int, seed: int, split: str) -> None:
        if not pairs:
            raise DataError(f"the {split} split holds no pairs")
        self.pairs, self.encoder_seq_len, self.decoder_seq_len = pairs, encoder_seq_len, decoder_seq_len
        self.pad, self.eos, self.seed, self.split = pad, eos, seed, split

    def rows(self, step: int, batch_size: int) -> list[int]:
        """The pair indices of step ``step``'s global batch."""
        return epoch_rows(len(self.pairs), step, batch_size, self.seed, _SPLIT_IDS[self.split])

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return seq2seq_batch([self.pairs[i] for i in self.rows(step, batch_size)], self.encoder_seq_len,
                             self.decoder_seq_len, self.pad, self.eos)
