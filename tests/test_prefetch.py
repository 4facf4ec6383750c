"""The prefetcher builds the same batches as the loop would, in order, bounded, across a
resume; its errors surface at the step that needed the batch."""

from __future__ import annotations

import time

import pytest
import torch

from fxmega.config import load, override
from fxmega.data.prefetch import Prefetcher
from fxmega.training.run import Run
from tests.conftest import ROOT


def _cfg(*extra: str):
    return override(load(ROOT / "configs" / "tiny_gpt.py"),
                    ["train.compile=false", "train.device=cpu", "train.steps=6", "train.global_batch_size=8",
                     "train.micro_batch_size=4", *extra])


def _equal(a, b) -> bool:
    (micros_a, count_a), (micros_b, count_b) = a, b
    return torch.equal(count_a, count_b) and len(micros_a) == len(micros_b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(micros_a, micros_b))


def test_prefetched_batches_equal_the_synchronous_ones_across_a_resume():
    run = Run(_cfg())
    synchronous = [run.host_batch(step) for step in range(6)]
    ahead = Prefetcher(run.host_batch, 0, 6, depth=2)
    assert all(_equal(ahead.get(step), synchronous[step]) for step in range(6))
    resumed = Prefetcher(run.host_batch, 3, 6, depth=2)  # a run resumed at step 3 starts its prefetcher there
    assert all(_equal(resumed.get(step), synchronous[step]) for step in range(3, 6))


def test_training_with_prefetch_equals_without_and_resumes_bit_identically(tmp_path):
    plain = Run(_cfg())
    expected = [plain.do_step()["loss"] for _ in range(6)]
    run = Run(_cfg())
    run.prefetch(2)
    losses = [run.do_step()["loss"] for _ in range(3)]
    run.save(str(tmp_path))
    run.finish_saves()
    losses += [run.do_step()["loss"] for _ in range(3)]
    run.stop_prefetch()
    assert losses == expected
    resumed = Run(_cfg())
    assert resumed.resume(str(tmp_path)) and resumed.step == 3
    resumed.prefetch(2)
    assert [resumed.do_step()["loss"] for _ in range(3)] == expected[3:]
    resumed.stop_prefetch()


def test_the_queue_is_bounded_and_errors_reach_the_step_that_needs_the_batch():
    built: list[int] = []

    def build(step: int) -> int:
        if step == 5:
            raise ValueError("sample 40 is corrupt")
        built.append(step)
        return step * 10

    ahead = Prefetcher(build, 0, 8, depth=2)
    time.sleep(0.3)
    assert built == [0, 1, 2]  # two waiting in the queue, one in hand
    assert [ahead.get(s) for s in range(5)] == [0, 10, 20, 30, 40]
    with pytest.raises(ValueError, match="sample 40 is corrupt"):
        ahead.get(5)
    other = Prefetcher(build, 0, 3, depth=1)
    with pytest.raises(RuntimeError, match="asked for step 1 but built step 0 next"):
        other.get(1)
    other.close()
    with pytest.raises(ValueError, match="at least 1"):
        Prefetcher(build, 0, 3, depth=0)
