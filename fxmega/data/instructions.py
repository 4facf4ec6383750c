"""Instruction tuning (SFT) data for decoder-only models: conversations rendered with one chat
template, the loss on the assistant's tokens only.

A row of the JSON-lines file is ``{"prompt": ..., "response": ...}``, ``{"src": ..., "tgt":
...}`` (parallel text: the source is the prompt) or ``{"messages": [{"role": "system" | "user"
| "assistant", "content": ...}, ...]}``. The template writes each message as
``<|role|>\\n{content}<|end|>\\n`` and each sample ends with the tokenizer's end-of-document
token where it has one; the assistant's content and its ``<|end|>`` carry the loss (so the
model learns to stop), nothing else does. A prompt for generation is the conversation so far
followed by ``<|assistant|>\\n``; generation stops at ``<|end|>``.

Samples are right-padded to ``seq_len + 1`` tokens (cut there) and shifted into inputs and
targets, as Megatron's SFT dataset does without packing; ``attention_mask`` marks the real
tokens, ``loss_mask`` the targets that are the assistant's. Batches are a pure function of
(seed, split, step), each epoch visiting every sample once.
"""

from __future__ import annotations

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


def sft_batch(samples: list[tuple[list[int], list[int]]], seq_len: int, pad: int = 0) -> dict[str, torch.Tensor]:
    """Inputs, targets, ``loss_mask`` (targets that are the assistant's) and ``attention_mask``
    of rendered samples, each cut or right-padded to ``seq_len + 1`` tokens and shifted."""
    b = len(samples)
    tokens = np.full((b, seq_len + 1), pad, dtype=np.int64)
    mine = np.zeros((b, seq_len + 1), dtype=np.float32)
    real = np.zeros((b, seq_len + 1), dtype=np.int64)
    for i, (ids, own) in enumerate(samples):
        n = min(len(ids), seq_len + 1)
        tokens[i, :n], mine[i, :n], real[i, :n] = ids[:n], own[:n], 1
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return {"inputs": as_tensor(tokens[:, :-1]), "targets": as_tensor(tokens[:, 1:]),
            "loss_mask": as_tensor(mine[:, 1:] * real[:, 1:]), "attention_mask": as_tensor(real[:, :-1])}


class InstructionBatches:
    """Global batches of rendered conversations, epoch after epoch in seeded orders."""

    def __init__(self, samples: list[tuple[list[int], list[int]]], seq_len: int, seed: int, split: str) -> None:
        if not samples:
            raise DataError(f"the {split} split holds no conversations")
        self.samples, self.seq_len, self.seed, self.split = samples, seq_len, seed, split

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        rows = epoch_rows(len(self.samples), step, batch_size, self.seed, _SPLIT_IDS[self.split])
        return sft_batch([self.samples[i] for i in rows], self.seq_len)
