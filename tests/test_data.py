"""Batches: deterministic per step, shifted targets, Megatron's micro-batch order."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fxmega.core.errors import DataError
from fxmega.data.batches import MockTokens, SampleBatches, TokenWindows, micro_batches, my_rows
from fxmega.data.corpus import EXPECTED_SHA256, ensure_shakespeare, sha256_of
from fxmega.ops.objectives import global_count
from fxmega.training.evaluate import my_step_input
from tests.conftest import ROOT


def test_windows_are_a_function_of_step():
    tokens = np.arange(1000, dtype=np.uint16)
    data = TokenWindows(tokens, seq_len=16, seed=3, split="train")
    a, b, c = data.global_batch(5, 4), data.global_batch(5, 4), data.global_batch(6, 4)
    assert torch.equal(a["inputs"], b["inputs"]) and not torch.equal(a["inputs"], c["inputs"])
    assert torch.equal(a["inputs"][:, 1:], a["targets"][:, :-1])  # targets are inputs shifted by one
    assert a["inputs"].shape == (4, 16) and a["inputs"].dtype == torch.int64


def test_too_short_split_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenWindows(np.arange(10), seq_len=16, seed=0, split="valid")


def test_mock_tokens_are_deterministic_and_in_vocab():
    data = MockTokens(vocab_size=50, seq_len=8, seed=1, split="train")
    a = data.global_batch(0, 3)
    assert torch.equal(a["inputs"], data.global_batch(0, 3)["inputs"])
    assert int(a["inputs"].max()) < 50


def test_micro_batches_follow_megatron_order():
    batch = {"inputs": torch.arange(8)[:, None]}
    # 2 accumulation steps x 2 data-parallel ranks x micro batch 2
    rank0 = micro_batches(batch, 2, dp_rank=0, dp_size=2)
    rank1 = micro_batches(batch, 2, dp_rank=1, dp_size=2)
    assert [m["inputs"].flatten().tolist() for m in rank0] == [[0, 1], [4, 5]]
    assert [m["inputs"].flatten().tolist() for m in rank1] == [[2, 3], [6, 7]]
    assert [m["inputs"].flatten().tolist() for m in micro_batches(batch, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]



def test_shakespeare_corpus_is_the_known_text():
    path = ensure_shakespeare(ROOT / "data", quiet=True)
    assert sha256_of(path) == EXPECTED_SHA256
    assert "To be, or not to be" in path.read_text(encoding="utf-8")


class _CountingSamples:
    """A dataset of windows that counts which samples are read."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.windows = np.arange(n * (seq_len + 1)).reshape(n, seq_len + 1) % 97
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> np.ndarray:
        self.read.append(i)
        return self.windows[i]


def _sources() -> list:
    return [TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=8, seed=3, split="train"),
            MockTokens(vocab_size=50, seq_len=8, seed=1, split="train"),
            SampleBatches(_CountingSamples(64, 8), 97, "train")]


@pytest.mark.parametrize("source", _sources(), ids=["windows", "mock", "samples"])
def test_rows_read_alone_equal_those_rows_of_the_global_batch(source):
    whole = source.global_batch(3, 8)
    for rows in ([0], [5, 6], [1, 4, 7], list(range(8))):
        part = source.batch_rows(3, 8, rows)
        for k, v in whole.items():
            assert torch.equal(part[k], v[rows]), (k, rows)


class _MaskedSource:
    """A source whose batches carry a loss mask: no ``batch_rows``, the count needs every row."""

    def global_batch(self, step: int, batch_size: int) -> dict:
        inputs = torch.arange(batch_size * 4).reshape(batch_size, 4) + step
        return {"inputs": inputs, "targets": inputs, "loss_mask": (inputs % 3 == 0).float()}


@pytest.mark.parametrize("source", [*_sources(), _MaskedSource()], ids=["windows", "mock", "samples", "masked"])
def test_each_data_rank_reads_its_micro_batches_and_the_global_count(source):
    batch, micro, dp = 8, 2, 2
    whole = source.global_batch(4, batch)
    for rank in range(dp):
        parallel = SimpleNamespace(groups=SimpleNamespace(data_rank=rank, data_size=dp), local_batch=lambda b: b)
        if isinstance(source, SampleBatches):
            source.dataset.read.clear()
        micros, count = my_step_input(source, 4, batch, micro, parallel)
        expected = micro_batches(whole, micro, rank, dp)
        assert len(micros) == len(expected)
        for got, want in zip(micros, expected):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert count.item() == global_count([whole]).item()
        if isinstance(source, SampleBatches):  # only this rank's samples were read
            assert sorted(source.dataset.read) == [4 * batch + r for r in my_rows(batch, micro, rank, dp)]
