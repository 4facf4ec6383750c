"""Sequence-classification data: JSON lines of ``{"text": str, "label": int | str}``.

Every text is tokenized once, truncated to ``seq_len`` and right-padded with 0; an
``attention_mask`` marks the real tokens. For BERT (``specials`` given) a row is
``[CLS] text [SEP]``, so that the [CLS] state (or the pooler) can stand for the text; for
GPT/Llama it is the text alone and the classifier reads its last real token.

String labels become ids in the sorted order of the training file's distinct labels (the
mapping is reported and returned); integer labels are ids already and must lie in 0..n-1.
Batches follow fxmega's rule: training batch ``step`` is a pure function of (seed, step),
drawn from shuffled epochs; validation batches cover every example once, in file order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fxmega.core.errors import ConfigError, DataError
from fxmega.data.mlm import Specials

_EPOCH_STREAM, _SPLIT_STREAM = 20, 21  # rng streams distinct from the other data sources'


@dataclass(frozen=True)
class Example:
    text: str
    label: int | str
    where: str  # "FILE:LINE", for errors


def read_jsonl(path: str | Path) -> list[Example]:
    """The examples of one file; any bad line is a DataError naming ``FILE:LINE``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"classification data {path} does not exist: give a JSON-lines file of "
                        f'{{"text": ..., "label": ...}} objects')
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where} is not valid JSON ({e}): write one object per line, "
                            f'e.g. {{"text": "great film", "label": "pos"}}') from None
        if not isinstance(obj, dict) or "text" not in obj or "label" not in obj:
            raise DataError(f'{where} needs an object with "text" and "label" fields, got {line[:80]!r}')
        text, label = obj["text"], obj["label"]
        if not isinstance(text, str):
            raise DataError(f'{where}: "text" must be a string, got {type(text).__name__} {text!r:.40}')
        if isinstance(label, bool) or not isinstance(label, (int, str)):  # JSON true/false are not class ids
            raise DataError(f'{where}: "label" must be an integer or a string, got {type(label).__name__} {label!r}')
        out.append(Example(text, label, where))
    if not out:
        raise DataError(f"classification data {path} holds no examples")
    return out


def label_names(train: list[Example], n_classes: int | None = None) -> list[int | str]:
    """Class names by id: the sorted distinct string labels, or 0..n-1 for integer labels
    (n: ``n_classes``, else the largest label + 1)."""
    kinds = {type(e.label) for e in train}
    if len(kinds) > 1:
        first_int = next(e for e in train if isinstance(e.label, int))
        first_str = next(e for e in train if isinstance(e.label, str))
        raise DataError(f"labels mix integers ({first_int.where}: {first_int.label}) and strings ({first_str.where}: "
                        f"{first_str.label!r}): use one kind throughout")
    if kinds == {str}:
        names: list[int | str] = sorted({e.label for e in train})
        if n_classes is not None and n_classes < len(names):
            raise ConfigError(f"n_classes={n_classes} but the data has {len(names)} distinct labels {names}: "
                              f"raise it or leave it unset")
        return names + [f"unused_{i}" for i in range(len(names), n_classes or len(names))]
    top = max(e.label for e in train)
    return list(range(n_classes if n_classes is not None else top + 1))


def label_ids(examples: list[Example], names: list[int | str]) -> np.ndarray:
    ids = {name: i for i, name in enumerate(names)}
    for e in examples:
        if e.label not in ids or type(e.label) is not type(names[0]):
            known = f"0..{len(names) - 1}" if isinstance(names[0], int) else ", ".join(map(repr, names))
            raise DataError(f"{e.where}: label {e.label!r} is not one of the classes ({known}); integer labels must "
                            f"be 0..n-1 (set n_classes), string labels must occur in the training file")
    return np.array([ids[e.label] for e in examples], dtype=np.int64)


def encode(examples: list[Example], tokenizer: object, seq_len: int, vocab_size: int,
           specials: Specials | None) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, attention_mask)``, both ``[N, seq_len]``: truncated, right-padded with 0."""
    room = seq_len - 2 if specials is not None else seq_len
    if room < 1:
        raise DataError(f"train.seq_len={seq_len} leaves no room for text between [CLS] and [SEP]")
    # ids reserved for [CLS]/[SEP]/[MASK] at the top of the vocabulary are no text token's
    limit = vocab_size - 3 if specials is not None and specials.cls >= vocab_size - 3 else vocab_size
    inputs = np.zeros((len(examples), seq_len), dtype=np.int64)
    mask = np.zeros((len(examples), seq_len), dtype=np.int64)
    for row, e in enumerate(examples):
        ids = list(tokenizer.encode(e.text))[:room]
        if not ids:
            raise DataError(f"{e.where}: the text is empty once tokenized; the classifier would have nothing to read")
        if max(ids) >= limit or min(ids) < 0:
            raise DataError(f"{e.where}: token id {max(ids)} is outside the {limit} ids the model's vocabulary "
                            f"(model.vocab_size={vocab_size}) gives text: match data.tokenizer to the model")
        if specials is not None:
            ids = [specials.cls, *ids, specials.sep]
        inputs[row, :len(ids)] = ids
        mask[row, :len(ids)] = 1
    return inputs, mask


class ClassificationData:
    """One split as tensors, with fxmega's batch interface."""

    def __init__(self, inputs: np.ndarray, mask: np.ndarray, labels: np.ndarray, seed: int,
                 token_types: bool) -> None:
        self.inputs, self.mask = torch.from_numpy(inputs), torch.from_numpy(mask)
        self.labels, self.seed, self.token_types = torch.from_numpy(labels), seed, token_types
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, _EPOCH_STREAM, epoch]).permutation(len(self))}
        return self._perms[epoch]

    def _rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = {"inputs": self.inputs[rows], "attention_mask": self.mask[rows], "targets": self.labels[rows]}
        if self.token_types:
            batch["token_types"] = torch.zeros_like(batch["inputs"])
        return batch

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Examples ``[step*B, (step+1)*B)`` of an endless stream of shuffled epochs (one
        permutation per epoch, from the seed), so any step's batch is known without state."""
        n = len(self)
        rows = [int(self._perm(k // n)[k % n]) for k in range(step * batch_size, (step + 1) * batch_size)]
        return self._rows(torch.tensor(rows))

    def eval_batches(self, batch_size: int) -> list[dict[str, torch.Tensor]]:
        """Every example once, in order, in batches of exactly ``batch_size`` (one shape:
        one compiled graph). The last batch is filled up with repeats of example 0 that
        ``loss_mask`` (``[B]``, 0/1) leaves out."""
        out = []
        for lo in range(0, len(self), batch_size):
            real = min(batch_size, len(self) - lo)
            rows = torch.cat([torch.arange(lo, lo + real), torch.zeros(batch_size - real, dtype=torch.long)])
            loss_mask = (torch.arange(batch_size) < real).float()
            out.append({**self._rows(rows), "loss_mask": loss_mask})
        return out


@dataclass
class ClassificationSplits:
    train: ClassificationData
    valid: ClassificationData
    labels: list[int | str]  # class name by id
    description: str


def load_classification(train_path: str | Path, tokenizer: object, seq_len: int, vocab_size: int, *,
                        specials: Specials | None = None, valid_path: str | Path | None = None,
                        valid_fraction: float = 0.1, n_classes: int | None = None,
                        seed: int = 0) -> ClassificationSplits:
    """Train and valid splits: ``valid_path``, or a deterministic ``valid_fraction`` of the
    training file (a seeded shuffle, so the held-out set does not depend on file order)."""
    train = read_jsonl(train_path)
    names = label_names(train, n_classes)
    if valid_path is not None:
        valid, where = read_jsonl(valid_path), f"valid {valid_path}"
    else:
        if not 0 < valid_fraction < 1 or len(train) < 2:
            raise DataError(f"holding out valid_fraction={valid_fraction} of {len(train)} examples in {train_path} "
                            f"leaves no train or no valid split: give a valid file or more examples")
        order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(len(train))
        n_valid = min(len(train) - 1, max(1, round(valid_fraction * len(train))))
        valid = [train[i] for i in sorted(order[:n_valid])]
        train = [train[i] for i in sorted(order[n_valid:])]
        where = f"valid: {n_valid} held out"
    splits = []
    for examples in (train, valid):
        inputs, mask = encode(examples, tokenizer, seq_len, vocab_size, specials)
        splits.append(ClassificationData(inputs, mask, label_ids(examples, names), seed, specials is not None))
    mapping = ", ".join(f"{name!r}->{i}" for i, name in enumerate(names))
    description = (f"{train_path} ({len(splits[0])} examples; {where}, {len(splits[1])} examples); "
                   f"{len(names)} classes: {mapping}")
    return ClassificationSplits(splits[0], splits[1], names, description)
