"""The compiled step: equal to eager, compiled once, and gradient accumulation equal to one
large micro batch."""

import pytest
from torch._dynamo.utils import counters

from fxmega.config import override
from fxmega.training.run import Run
from tests.tolerance import assert_runs_match


def run_steps(cfg, n):
    run = Run(cfg)
    metrics = [run.do_step() for _ in range(n)]
    return metrics, run


@pytest.mark.slow
def test_compiled_equals_eager_and_compiles_once(tiny_gpt):
    eager, _ = run_steps(override(tiny_gpt, ["train.compile=false"]), 5)
    counters.clear()
    compiled, _ = run_steps(override(tiny_gpt, ["train.compile=true"]), 5)
    assert_runs_match(compiled, eager, tiny_gpt, "compiled against eager")  # inductor fuses: other orders
    assert eager[-1]["loss"] < eager[0]["loss"]
    assert counters["stats"]["unique_graphs"] == 1  # five steps, one graph: no recompilation


@pytest.mark.slow
def test_llama_compiled_with_accumulation_equals_eager(tiny_llama):
    # two micro batches per step: the accumulate graph and the update graph, each compiled once
    cfg = override(tiny_llama, ["train.micro_batch_size=4", "train.global_batch_size=8"])
    eager, _ = run_steps(override(cfg, ["train.compile=false"]), 4)
    counters.clear()
    compiled, _ = run_steps(cfg, 4)
    assert_runs_match(compiled, eager, cfg, "compiled against eager")
    assert counters["stats"]["unique_graphs"] == 2


def test_accumulation_equals_one_large_micro_batch(tiny_gpt):
    base = override(tiny_gpt, ["train.compile=false", "train.global_batch_size=8"])
    one, _ = run_steps(override(base, ["train.micro_batch_size=8"]), 4)
    four, _ = run_steps(override(base, ["train.micro_batch_size=2"]), 4)
    # the loss and the gradient norm at every step: parameters after AdamW are not compared,
    # since AdamW turns a rounding-level difference in a near-zero gradient into a step of up
    # to lr, so they bound nothing that the gradient norm does not
    assert_runs_match(four, one, base, "four micro batches against one")
