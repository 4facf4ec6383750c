"""The train and validation data a run's config asks for.

``data.source`` is one of: ``mock`` (synthetic tokens); ``shakespeare`` (the default
corpus, fetched) or the path of a UTF-8 text file (tokenized in memory, tail held out for
validation); or Megatron-style indexed data — a prefix of ``.bin/.idx`` files, or a blend
``"0.7 PREFIX_A 0.3 PREFIX_B"`` — split into train/valid/test by ``data.split``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxmega.core.errors import ConfigError, DataError
from fxmega.data.batches import MockTokens, SampleBatches, TokenWindows
from fxmega.data.blend import BlendedDataset, blend_counts, parse_data_path
from fxmega.data.corpus import ensure_shakespeare
from fxmega.data.gpt_dataset import GPTDataset, parse_split
from fxmega.data.indexed import IndexedDataset, index_path
from fxmega.data.instructions import InstructionBatches, read_conversations, render
from fxmega.data.mlm import MaskedLM, specials_for
from fxmega.data.parallel_text import PairBatches, encode_pairs, hash_fraction, read_pairs
from fxmega.data.span_corruption import SpanCorruption, SpanSpecials, raw_length
from fxmega.data.tokenizer import build_tokenizer
from fxmega.models import model_for


@dataclass
class Data:
    train: Any  # has global_batch(step, batch_size)
    valid: Any
    tokenizer: Any  # None for mock data
    description: str  # what the batches come from, for the log and the checkpoint


def build_data(cfg, objective: str = "causal-lm") -> Data:
    """The train and validation batches for ``cfg`` and an objective by name: a masked
    LM (``masked-lm``) reads the same token sources, masked (``fxmega.data.mlm``); T5's
    ``span-corruption`` reads longer windows of them, corrupted
    (``fxmega.data.span_corruption``)."""
    if cfg.data.task == "seq2seq":
        return _pairs(cfg)
    if cfg.data.task == "sft":
        return _instructions(cfg)
    if objective == "span-corruption":
        return _span_corruption(cfg)
    data = _token_data(cfg)
    if objective != "masked-lm":
        return data
    t, vocab = cfg.train, cfg.model.vocab_size
    specials = specials_for(data.tokenizer, vocab)
    train, valid = data.train, data.valid
    if cfg.data.source == "mock":  # synthetic ids below the three reserved for the specials
        train, valid = (MockTokens(vocab - 3, t.seq_len, t.seed, split) for split in ("train", "valid"))
    train, valid = (MaskedLM(source, specials, vocab, t.seq_len, t.seed, split)
                    for source, split in ((train, "train"), (valid, "valid")))
    return Data(train, valid, data.tokenizer, data.description)


def _pairs(cfg) -> Data:
    d, t, m = cfg.data, cfg.train, cfg.model
    if not model_for(m).is_encoder_decoder:
        raise ConfigError(f"data.task=seq2seq trains an encoder-decoder (t5) on source -> target pairs; the model is "
                          f"a {type(m).__module__.rsplit('.', 1)[-1]}")
    if d.source in ("mock", "shakespeare"):
        raise ConfigError(f"data.task=seq2seq reads pairs: give --data-path PAIRS.jsonl ({{\"src\", \"tgt\"}} lines) "
                          f"or SRC.txt,TGT.txt, not {d.source!r}")
    _check_source_length(t, m)
    tokenizer = build_tokenizer(d.tokenizer, d.data_dir)
    train, valid = _train_valid(d, read_pairs, lambda pair: pair[0])
    batches = (PairBatches(encode_pairs(p, tokenizer), m.encoder_seq_len, m.decoder_seq_len, m.pad_id, m.eos_id,
                           t.seed, split) for p, split in ((train, "train"), (valid, "valid")))
    return Data(*batches, tokenizer, f"{d.source} ({len(train):,} train and {len(valid):,} validation pairs, "
                                     f"{tokenizer.name} tokens)")


def _check_source_length(t, m) -> None:
    if t.seq_len != m.encoder_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len}: for T5 it is the source length and must equal "
                          f"model.encoder_seq_len={m.encoder_seq_len} (Megatron's --seq-length)")


def _train_valid(d, read: Callable[[str], list], key: Callable[[Any], str]) -> tuple[list, list]:
    """The samples ``read`` gives of ``data.source`` and of ``data.valid_source``; without the
    latter, ``data.valid_fraction`` of the source's held out by a hash of each sample's
    ``key``, the same whatever the file's order."""
    rows = read(d.source)
    if d.valid_source:
        return rows, read(d.valid_source)
    held = [hash_fraction(key(r)) < d.valid_fraction for r in rows]
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def _instructions(cfg) -> Data:
    d, t, m = cfg.data, cfg.train, cfg.model
    if hasattr(m, "encoder_seq_len"):
        raise ConfigError("data.task=sft trains a decoder-only model on conversations; for an encoder-decoder (t5) "
                          "use data.task=seq2seq")
    if d.source in ("mock", "shakespeare"):
        raise ConfigError(f"data.task=sft reads conversations: give --data-path CHATS.jsonl ({{\"messages\"}}, "
                          f"{{\"prompt\", \"response\"}} or {{\"src\", \"tgt\"}} lines), not {d.source!r}")
    tokenizer = build_tokenizer(d.tokenizer, d.data_dir)
    train, valid = _train_valid(d, read_conversations, json.dumps)
    batches = (InstructionBatches([render(c, tokenizer) for c in rows], t.seq_len, t.seed, split, d.pack)
               for rows, split in ((train, "train"), (valid, "valid")))
    packed = ", packed with document masks" if d.pack else ""
    return Data(*batches, tokenizer, f"{d.source} ({len(train):,} train and {len(valid):,} validation "
                                     f"conversations{packed}, {tokenizer.name} tokens, loss on the assistant's)")


def _span_corruption(cfg) -> Data:
    t, m = cfg.train, cfg.model
    _check_source_length(t, m)
    specials = SpanSpecials(m.pad_id, m.eos_id, tuple(m.sentinel(k) for k in range(m.n_sentinels)))
    raw = raw_length(m.encoder_seq_len, m.decoder_seq_len)
    data = _token_data(dataclasses.replace(cfg, train=dataclasses.replace(t, seq_len=raw)))
    train, valid = data.train, data.valid
    if cfg.data.source == "mock":  # synthetic ids below the specials (which sit at the top of a mock vocabulary)
        low = min(specials.pad, specials.eos, *specials.sentinels)
        if low < 16:
            raise ConfigError(f"mock data for T5 draws its ids below the specials, but model.pad_id / eos_id / the "
                              f"sentinels start at {low}: put them at the top of the vocabulary (configs/tiny_t5.py)")
        train, valid = (MockTokens(low, raw, t.seed, split) for split in ("train", "valid"))
    train, valid = (SpanCorruption(source, specials, m.encoder_seq_len, m.decoder_seq_len, t.seed, split)
                    for source, split in ((train, "train"), (valid, "valid")))
    return Data(train, valid, data.tokenizer, f"{data.description}, span-corrupted ({raw}-token windows)")


def _token_data(cfg) -> Data:
    t, d = cfg.train, cfg.data
    vocab = cfg.model.vocab_size
    if d.source == "mock":
        return Data(MockTokens(vocab, t.seq_len, t.seed, "train"), MockTokens(vocab, t.seq_len, t.seed, "valid"),
                    None, f"mock tokens (seed {t.seed})")
    tokenizer = build_tokenizer(d.tokenizer, d.data_dir)
    if vocab < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the {tokenizer.name} tokenizer's "
                          f"{tokenizer.vocab_size:,} tokens: set model.vocab_size >= {tokenizer.vocab_size}")
    if d.source == "shakespeare":
        return _text(cfg, ensure_shakespeare(d.data_dir), tokenizer)
    blend = parse_data_path(d.source)
    if all(index_path(prefix).is_file() for _, prefix in blend):
        return _indexed(cfg, blend, tokenizer)
    if len(blend) == 1 and Path(blend[0][1]).is_file():
        return _text(cfg, Path(blend[0][1]), tokenizer)
    missing = next(p for _, p in blend if not index_path(p).is_file())
    raise DataError(f"data.source: {missing!r} is neither a text file nor the prefix of an indexed dataset "
                    f"({missing}.idx does not exist); make one with python -m fxmega.data.preprocess")


def _text(cfg, path: Path, tokenizer) -> Data:
    t, d = cfg.train, cfg.data
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data.source={str(path)!r} as UTF-8 text: {e}") from None
    tokens = tokenizer.encode_array(text) if hasattr(tokenizer, "encode_array") else _as_array(tokenizer.encode(text))
    n_valid = max(t.seq_len + 2, int(len(tokens) * d.valid_fraction))
    return Data(TokenWindows(tokens[:-n_valid], t.seq_len, t.seed, "train"),
                TokenWindows(tokens[-n_valid:], t.seq_len, t.seed, "valid"), tokenizer,
                f"{path} ({len(tokens):,} {tokenizer.name} tokens, last {d.valid_fraction:.0%} for validation)")


def _as_array(ids: list[int]):
    import numpy as np

    return np.asarray(ids, dtype=np.int32)


def _indexed(cfg, blend: list[tuple[float, str]], tokenizer) -> Data:
    t, d = cfg.train, cfg.data
    split = parse_split(d.split)
    cache = d.cache_dir or str(Path(d.data_dir) / "index-cache")
    datasets = [IndexedDataset(prefix) for _, prefix in blend]
    weights = [w for w, _ in blend]
    sizes = {"train": t.steps * t.global_batch_size, "valid": t.eval_iters * t.global_batch_size}
    sources = {}
    for name, size in sizes.items():
        counts = blend_counts(weights, size)
        parts = [GPTDataset(ds, name, split, t.seq_len, max(int(n), 1), t.seed, cache)
                 for ds, n in zip(datasets, counts)]
        dataset = parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, size)
        sources[name] = SampleBatches(dataset, cfg.model.vocab_size, name)
    what = " + ".join(f"{w:.3g} x {p}" if len(blend) > 1 else p for w, p in blend)
    docs = sum(ds.n_documents for ds in datasets)
    tokens = sum(ds.n_tokens for ds in datasets)
    return Data(sources["train"], sources["valid"], tokenizer,
                f"indexed {what} ({docs:,} documents, {tokens:,} tokens, split {d.split})")
