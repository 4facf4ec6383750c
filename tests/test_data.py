"""Batches: deterministic per step, shifted targets, Megatron's micro-batch order."""

import numpy as np
import pytest
import torch

from fxmega.core.errors import DataError
from fxmega.data.batches import MockTokens, TokenWindows, micro_batches
from fxmega.data.corpus import EXPECTED_SHA256, ensure_shakespeare, sha256_of
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
