"""T5 pre-training batches by span corruption (Raffel et al., section 3.1.4; the algorithm of
T5's ``random_spans_noise_mask``), from any token source.

Of each window of ``raw_len`` tokens, ``round(raw_len x noise_density)`` are noise, in
``round(noise / mean_span)`` spans of random lengths (at least 1) separated by non-noise
runs of random lengths (at least 1, the window starting with one). The source side keeps
the non-noise tokens with each noise span replaced by one sentinel (``<extra_id_0>``,
``<extra_id_1>``, ...), then EOS; the target side is each sentinel followed by the span it
stands for, then EOS. Both lengths are fixed by ``raw_len``, so ``raw_len`` is chosen as
the largest window whose source fits ``encoder_seq_len`` (T5's
``compute_input_and_target_lengths``); the target side must fit ``decoder_seq_len``, and
both are padded to them.

A batch holds ``inputs [B, src]`` (the source), ``decoder_inputs [B, tgt]`` (the targets
shifted right behind the start token, T5's pad), ``targets``, ``loss_mask`` (1 for real
target tokens) and ``attention_mask [B, src + tgt]`` (1 for real tokens of the stream;
``fxmega.models.t5``). Masks are a pure function of (seed, split, step), like every batch
in fxmega: any mesh and a resumed run see the same spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fxmega.core.errors import ConfigError, DataError
from fxmega.data.parallel_text import stream_batch

_SPLIT_IDS = {"train": 20, "valid": 21}  # distinct from the token sampling's and MLM's streams


@dataclass(frozen=True)
class SpanSpecials:
    pad: int
    eos: int
    sentinels: tuple[int, ...]  # <extra_id_0>, <extra_id_1>, ...


def lengths(raw_len: int, noise_density: float = 0.15, mean_span: float = 3.0) -> tuple[int, int, int, int]:
    """``(noise tokens, noise spans, source length, target length)`` of a window of ``raw_len``."""
    noise = min(max(int(round(raw_len * noise_density)), 1), raw_len - 1)
    spans = max(int(round(noise / mean_span)), 1)
    spans = min(spans, noise, raw_len - noise)  # each span and each run between needs a token
    return noise, spans, raw_len - noise + spans + 1, noise + spans + 1


def raw_length(encoder_seq_len: int, decoder_seq_len: int, noise_density: float = 0.15,
               mean_span: float = 3.0) -> int:
    """The longest window whose corrupted source fits ``encoder_seq_len``; a ``ConfigError``
    naming the decoder length needed when its target side does not fit ``decoder_seq_len``."""
    if encoder_seq_len < 4:
        raise ConfigError(f"model.encoder_seq_len={encoder_seq_len}: span corruption needs at least 4 source tokens")
    raw = 2
    while lengths(raw + 1, noise_density, mean_span)[2] <= encoder_seq_len:
        raw += 1
    need = lengths(raw, noise_density, mean_span)[3]
    if need > decoder_seq_len:
        raise ConfigError(f"span corruption of {raw}-token windows (source {encoder_seq_len}) makes {need} target "
                          f"tokens, more than model.decoder_seq_len={decoder_seq_len}: raise it to {need}")
    return raw


def _segments(rng: np.random.Generator, items: int, segments: int) -> np.ndarray:
    """``items`` split into ``segments`` random non-empty runs, in order (their lengths)."""
    cuts = np.sort(rng.choice(np.arange(1, items), size=segments - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [items]]))


def noise_mask(rng: np.random.Generator, raw_len: int, noise_density: float = 0.15,
               mean_span: float = 3.0) -> np.ndarray:
    """``[raw_len]`` booleans, True on the noise tokens: non-noise and noise runs alternate,
    starting with non-noise."""
    noise, spans, _, _ = lengths(raw_len, noise_density, mean_span)
    runs = np.stack([_segments(rng, raw_len - noise, spans), _segments(rng, noise, spans)], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, specials: SpanSpecials) -> tuple[np.ndarray, np.ndarray]:
    """``(source, target)`` of one window: noise spans replaced by sentinels on the source,
    sentinels followed by their spans on the target, each ending in EOS."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    span_of = np.cumsum(starts) - 1  # the span index of each noise token
    sentinel = np.asarray(specials.sentinels)
    source = np.where(starts, sentinel[np.maximum(span_of, 0)], tokens)[~mask | starts]
    target_parts = []
    for k, start in enumerate(np.flatnonzero(starts)):
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        target_parts += [[sentinel[k]], tokens[start:end]]
    target = np.concatenate(target_parts) if target_parts else np.zeros(0, dtype=tokens.dtype)
    return np.append(source, specials.eos), np.append(target, specials.eos)


def span_batch(windows: np.ndarray, rng: np.random.Generator, specials: SpanSpecials, encoder_seq_len: int,
               decoder_seq_len: int, noise_density: float = 0.15, mean_span: float = 3.0) -> dict[str, torch.Tensor]:
    """The T5 batch (see the module docstring) of ``windows [B, raw_len]``."""
    pairs = [corrupt(row, noise_mask(rng, len(row), noise_density, mean_span), specials) for row in windows]
    return stream_batch(pairs, encoder_seq_len, decoder_seq_len, specials.pad)


class SpanCorruption:
    """Wraps a source of global batches of ``raw_length(...)``-token windows (``TokenWindows``,
    ``SampleBatches``, ``MockTokens``) into T5 span-corruption batches."""

    def __init__(self, source: object, specials: SpanSpecials, encoder_seq_len: int, decoder_seq_len: int,
                 seed: int, split: str, noise_density: float = 0.15, mean_span: float = 3.0) -> None:
        self.raw_len = raw_length(encoder_seq_len, decoder_seq_len, noise_density, mean_span)
        spans = lengths(self.raw_len, noise_density, mean_span)[1]
        if spans > len(specials.sentinels):
            raise ConfigError(f"span corruption of {self.raw_len}-token windows makes {spans} spans but the model has "
                              f"{len(specials.sentinels)} sentinels: raise model.n_sentinels to {spans}")
        self.source, self.specials = source, specials
        self.encoder_seq_len, self.decoder_seq_len = encoder_seq_len, decoder_seq_len
        self.seed, self.split, self.noise_density, self.mean_span = seed, split, noise_density, mean_span
        self.reserved = np.asarray(sorted({specials.pad, specials.eos, *specials.sentinels}))

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        windows = self.source.global_batch(step, batch_size)["inputs"].numpy()[:, :self.raw_len].astype(np.int64)
        clash = np.isin(windows, self.reserved)
        if clash.any():
            token = int(windows[clash][0])
            raise DataError(f"token id {token} of the data is one of the ids the model reserves for pad, EOS and "
                            f"the sentinels ({self.reserved.min()}..{self.reserved.max()}): raise model.vocab_size "
                            f"above the data's vocabulary and put the specials there")
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], step])
        return span_batch(windows, rng, self.specials, self.encoder_seq_len, self.decoder_seq_len,
                          self.noise_density, self.mean_span)
