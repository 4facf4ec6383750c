"""Learning-rate schedules at chosen steps."""

import math

import pytest

from fxmega.config import OptimConfig
from fxmega.training.schedules import lr_at


def opt(**kw):
    return OptimConfig(**{"lr": 1.0, "min_lr": 0.1, **kw})


def test_warmup_is_linear_and_reaches_lr():
    o = opt(schedule="constant", warmup_steps=4)
    assert [lr_at(s, o, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine():
    o = opt(schedule="cosine", warmup_steps=10)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # halfway: mean of lr and min_lr
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    assert lr_at(500, o, 110) == pytest.approx(0.1)  # stays at min_lr after the decay


def test_linear_with_explicit_decay_steps():
    o = opt(schedule="linear", warmup_steps=0, decay_steps=10)
    assert lr_at(0, o, 1000) == pytest.approx(1.0)
    assert lr_at(5, o, 1000) == pytest.approx(0.55)
    assert lr_at(10, o, 1000) == pytest.approx(0.1)


def test_wsd_holds_then_decays():
    o = opt(schedule="wsd", warmup_steps=10, wsd_decay_steps=20, wsd_decay_style="linear")
    assert lr_at(50, o, 100) == 1.0
    assert lr_at(79, o, 100) == 1.0
    assert lr_at(89, o, 100) == pytest.approx(0.1 + 0.9 * (1 - 10 / 20))
    assert lr_at(99, o, 100) == pytest.approx(0.1)
    sq = opt(schedule="wsd", wsd_decay_steps=20)  # default style 1-sqrt
    assert lr_at(84, sq, 100) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(5 / 20)))


def test_inverse_sqrt():
    o = opt(schedule="inverse-sqrt", warmup_steps=100, min_lr=0.0)
    assert lr_at(99, o, 10_000) == pytest.approx(1.0)
    assert lr_at(399, o, 10_000) == pytest.approx(0.5)
