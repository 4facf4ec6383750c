"""Instruction tuning (SFT) data for decoder-only models: conversations rendered with one chat
template, the loss on the assistant's tokens only.

A row of the JSON-lines file is ``{"prompt": ..., "response": ...}``, ``{"src": ..., "tgt":
...}`` (parallel text: the source is the prompt) or ``{"messages": [{"role": "system" | "user"
| "assistant", "content": ...}, ...]}``. The template writes each message as
``<|role|>\\n{content}<|end|>\\n`` and each sample ends with the tokenizer's end-of-document
token where it has one; the assistant's content and its ``<|end|>`` carry the loss (so the
model learns to stop), nothing else does. A prompt for generation is the conversation so far
followed by ``<|assistant|>\\n``; generation stops at ``<|end|>``.

Each sample is cut to ``seq_len + 1`` tokens and shifted into inputs and targets on its own.
Unpacked, a row holds one sample, right-padded (Megatron's SFT dataset without packing).
Packed, a row holds several (best-fit decreasing by length, once per split: NeMo's packed
SFT), and attention stays inside each: ``attention_mask`` holds each token's document in its
row (0 for padding, 1 throughout an unpacked row), from which the blocks build a
block-diagonal causal mask, and ``positions`` restart at 0 in every document, so a packed
sample is computed exactly as it would be alone. ``loss_mask`` marks the targets that are
the assistant's. Batches are a pure function of (seed, split, step), each epoch visiting
every row once.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxmega.core.errors import DataError
from fxmega.data.batches import epoch_rows

END = "<|end|>"
ROLES = ("system", "user", "assistant")
_SPLIT_IDS = {"train": 40, "valid": 41}


def _row_messages(row: Any, where: str) -> list[dict[str, str]]:
    if isinstance(row, dict) and "messages" in row:
        messages = row["messages"]
    elif isinstance(row, dict) and {"prompt", "response"} <= row.keys():
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    elif isinstance(row, dict) and {"src", "tgt"} <= row.keys():
        messages = [{"role": "user", "content": row["src"]}, {"role": "assistant", "content": row["tgt"]}]
    else:
        raise DataError(f"{where}: expected {{\"messages\": [...]}}, {{\"prompt\", \"response\"}} or {{\"src\", "
                        f"\"tgt\"}}, got {str(row)[:80]!r}")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: a message must be {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}, "
                            f"got {str(m)[:80]!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to learn from")
    return messages


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations of a JSON-lines file (see the module docstring)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read instruction data {str(path)!r}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{n}: not a JSON object: {line[:80]!r}") from None
            out.append(_row_messages(row, f"{path}:{n}"))
    if not out:
        raise DataError(f"{path} holds no conversations")
    return out


def header(role: str) -> str:
    return f"<|{role}|>\n"


def prompt_text(messages: list[dict[str, str]]) -> str:
    """What generation continues: the conversation so far, then the assistant's header."""
    return "".join(header(m["role"]) + m["content"] + END + "\n" for m in messages) + header("assistant")


def render(messages: list[dict[str, str]], tokenizer: Any) -> tuple[list[int], list[int]]:
    """The conversation's token ids and, per id, 1 where it is the assistant's (its content
    and ``<|end|>``; then the end-of-document token, where the tokenizer has one)."""
    ids: list[int] = []
    mine: list[int] = []
    for m in messages:
        head, body = tokenizer.encode(header(m["role"])), tokenizer.encode(m["content"] + END)
        tail = tokenizer.encode("\n")
        ids += head + body + tail
        mine += [0] * len(head) + [int(m["role"] == "assistant")] * len(body) + [0] * len(tail)
    eod = getattr(tokenizer, "eod", None)
    if eod is not None:
        ids.append(eod)
        mine.append(1)
    return ids, mine


Sample = tuple[list[int], list[int]]  # a rendered conversation: token ids, 1 where the assistant's


def _shifted_length(sample: Sample, seq_len: int) -> int:
    return min(len(sample[0]), seq_len + 1) - 1


def pack(samples: list[Sample], seq_len: int) -> list[list[int]]:
    """The samples' indices grouped into rows of at most ``seq_len`` shifted tokens: best fit
    decreasing (each sample, longest first, into the fullest row it still fits in), ties by
    index, so the packing is a function of the samples alone."""
    lengths = [_shifted_length(s, seq_len) for s in samples]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the fullest row that fits is a bisection away
    for i in sorted(range(len(samples)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            room, row = seq_len - lengths[i], len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, row))
    return rows


def sft_batch(rows: list[list[Sample]], seq_len: int, pad: int = 0, packed: bool = False) -> dict[str, torch.Tensor]:
    """Inputs, targets, ``loss_mask`` (targets that are the assistant's) and ``attention_mask``
    (each token's document in its row, 0 for padding) of rows of samples, each sample cut to
    ``seq_len + 1`` tokens and shifted; with ``packed``, each token's ``positions`` in its
    document too (padding counts on from 0 as a document of its own, so that a document and
    a position name each token of a row once)."""
    b = len(rows)
    inputs, targets = np.full((b, seq_len), pad, dtype=np.int64), np.full((b, seq_len), pad, dtype=np.int64)
    mine = np.zeros((b, seq_len), dtype=np.float32)
    documents, positions = np.zeros((b, seq_len), dtype=np.int64), np.zeros((b, seq_len), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for document, (ids, own) in enumerate(row, 1):
            n = _shifted_length((ids, own), seq_len)
            if at + n > seq_len:
                raise DataError(f"row {r} holds {at + n} tokens, more than seq_len={seq_len}")
            span = slice(at, at + n)
            inputs[r, span], targets[r, span], mine[r, span] = ids[:n], ids[1:n + 1], own[1:n + 1]
            documents[r, span], positions[r, span] = document, np.arange(n)
            at += n
        positions[r, at:] = np.arange(seq_len - at)
    batch = {"inputs": inputs, "targets": targets, "loss_mask": mine, "attention_mask": documents}
    if packed:
        batch["positions"] = positions
    return {k: torch.from_numpy(v) for k, v in batch.items()}


class InstructionBatches:
    """Global batches of rendered conversations, one per row or packed (see the module
    docstring), epoch after epoch in seeded orders."""

    def __init__(self, samples: list[Sample], seq_len: int, seed: int, split: str, packed: bool = False) -> None:
        if not samples:
            raise DataError(f"the {split} split holds no conversations")
        self.seq_len, self.seed, self.split, self.packed = seq_len, seed, split, packed
        groups = pack(samples, seq_len) if packed else [[i] for i in range(len(samples))]
        self.rows = [[samples[i] for i in group] for group in groups]

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        rows = epoch_rows(len(self.rows), step, batch_size, self.seed, _SPLIT_IDS[self.split])
        return sft_batch([self.rows[i] for i in rows], self.seq_len, packed=self.packed)
