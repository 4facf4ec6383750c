"""Masked-language-model batches (BERT pre-training) from any token source.

Each sample is ``[CLS] tokens [SEP]`` (``seq_len`` in all; no next-sentence pairs, as in
RoBERTa). 15% of the non-special positions are chosen for prediction; of those, 80% become
``[MASK]``, 10% a random token and 10% stay as they are (Devlin et al.). ``targets`` hold the
original tokens and ``loss_mask`` the chosen positions, so the loss is the usual summed
cross-entropy over the masked positions only.

Masks are a pure function of (seed, split, step), like every batch in fxmega: any mesh and a
resumed run see the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fxmega.core.errors import DataError

_SPLIT_IDS = {"train": 10, "valid": 11}  # distinct from the token sampling's streams


@dataclass(frozen=True)
class Specials:
    cls: int
    sep: int
    mask: int


def specials_for(tokenizer: object, vocab_size: int) -> Specials:
    """The tokenizer's ``[CLS]``, ``[SEP]`` and ``[MASK]`` ids (a BERT WordPiece vocabulary),
    or the top three ids of the model's vocabulary for tokenizers without them (byte-level
    and synthetic data, whose ids must then stay below ``vocab_size - 3``)."""
    find = getattr(tokenizer, "token_id", None)
    if find is not None:
        ids = [find(name) for name in ("[CLS]", "[SEP]", "[MASK]")]
        if all(i is not None for i in ids):
            return Specials(*ids)
    return Specials(vocab_size - 3, vocab_size - 2, vocab_size - 1)


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, specials: Specials, vocab_size: int,
                probability: float = 0.15) -> dict[str, torch.Tensor]:
    """``[CLS] tokens [SEP]`` per row of ``tokens [batch, seq_len - 2]``, masked for MLM."""
    batch = tokens.shape[0]
    seq = np.concatenate([np.full((batch, 1), specials.cls), tokens, np.full((batch, 1), specials.sep)], axis=1)
    chosen = rng.random(seq.shape) < probability
    chosen[:, 0] = chosen[:, -1] = False  # never the specials
    roll = rng.random(seq.shape)
    inputs = seq.copy()
    inputs[chosen & (roll < 0.8)] = specials.mask
    random_slots = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[random_slots] = rng.integers(0, vocab_size, size=int(random_slots.sum()))
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))  # noqa: E731
    return {"inputs": as_tensor(inputs), "targets": as_tensor(seq), "loss_mask": torch.from_numpy(chosen).float(),
            "token_types": torch.zeros(seq.shape, dtype=torch.int64),
            "attention_mask": torch.ones(seq.shape, dtype=torch.int64)}


class MaskedLM:
    """Wraps a source of global batches (``TokenWindows``, ``SampleBatches``, ``MockTokens``)
    into MLM batches of ``seq_len`` tokens."""

    def __init__(self, source: object, specials: Specials, vocab_size: int, seq_len: int, seed: int,
                 split: str) -> None:
        if seq_len < 3:
            raise DataError(f"train.seq_len={seq_len}: a masked-LM sample needs [CLS], tokens and [SEP]")
        self.source, self.specials, self.vocab_size = source, specials, vocab_size
        self.seq_len, self.seed, self.split = seq_len, seed, split

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        windows = self.source.global_batch(step, batch_size)["inputs"].numpy()[:, :self.seq_len - 2]
        reserved = min(self.specials.cls, self.specials.sep, self.specials.mask)
        if self.specials.cls >= self.vocab_size - 3 and int(windows.max()) >= reserved:
            raise DataError(f"token id {int(windows.max())} collides with the ids reserved for [CLS]/[SEP]/[MASK] "
                            f"({reserved}..{self.vocab_size - 1}): raise model.vocab_size by 3 above the data's "
                            f"vocabulary, or use a tokenizer with those tokens")
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], step])
        return mask_tokens(windows, rng, self.specials, self.vocab_size)
