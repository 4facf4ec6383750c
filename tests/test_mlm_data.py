"""Masked-LM batches: 15% of the non-special positions chosen, 80/10/10 [MASK]/random/kept,
deterministic per (seed, split, step), specials never masked, clear errors."""

import pytest
import torch

from fxmega.core.errors import DataError
from fxmega.data.batches import MockTokens
from fxmega.data.mlm import MaskedLM, Specials, specials_for

VOCAB = 259
SPECIALS = Specials(256, 257, 258)


def test_masking_rates_and_layout():
    data = MaskedLM(MockTokens(256, 130, seed=1, split="train"), SPECIALS, VOCAB, 128, seed=1, split="train")
    b = data.global_batch(0, 400)
    inputs, targets, chosen = b["inputs"], b["targets"], b["loss_mask"].bool()
    assert inputs.shape == targets.shape == (400, 128)
    assert torch.all(targets[:, 0] == 256) and torch.all(targets[:, -1] == 257)
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    n = chosen.sum().item()
    assert abs(n / (400 * 126) - 0.15) < 0.01  # of 50,400 maskable positions
    masked = (inputs == 258) & chosen
    kept = (inputs == targets) & chosen
    assert abs(masked.sum().item() / n - 0.8) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02  # (a random token equal to the original also counts: 0.04%)
    assert torch.equal(inputs[~chosen], targets[~chosen])  # unchosen positions untouched
    assert torch.all(b["attention_mask"] == 1) and torch.all(b["token_types"] == 0)


def test_masks_are_a_function_of_seed_split_and_step():
    make = lambda split: MaskedLM(MockTokens(256, 66, 3, split), SPECIALS, VOCAB, 64, seed=3, split=split)  # noqa
    a, b = make("train").global_batch(5, 8), make("train").global_batch(5, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["loss_mask"], make("train").global_batch(6, 8)["loss_mask"])
    assert not torch.equal(a["loss_mask"], make("valid").global_batch(5, 8)["loss_mask"])


def test_reserved_ids_collision_and_tokenizer_specials():
    data = MaskedLM(MockTokens(259, 34, 0, "train"), SPECIALS, VOCAB, 32, seed=0, split="train")
    with pytest.raises(DataError, match="collides with the ids reserved for"):
        for step in range(20):
            data.global_batch(step, 16)

    class WordPiece:
        def token_id(self, token):
            return {"[CLS]": 101, "[SEP]": 102, "[MASK]": 103}[token]

    assert specials_for(WordPiece(), 30522) == Specials(101, 102, 103)
    assert specials_for(object(), 300) == Specials(297, 298, 299)
