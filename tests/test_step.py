"""The compiled step: equal to eager, compiled once, and gradient accumulation equal to one
large micro batch."""

import torch
from torch._dynamo.utils import counters

from fxmega import tree
from fxmega.config import override
from fxmega.train import Run


def run_steps(cfg, n):
    run = Run(cfg)
    losses = [run.do_step()["loss"] for _ in range(n)]
    return losses, run


def test_compiled_equals_eager_and_compiles_once(tiny_gpt):
    eager, _ = run_steps(override(tiny_gpt, ["train.compile=false"]), 5)
    counters.clear()
    compiled, _ = run_steps(override(tiny_gpt, ["train.compile=true"]), 5)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert eager[-1] < eager[0]
    assert counters["stats"]["unique_graphs"] == 1  # five steps, one graph: no recompilation


def test_llama_compiled_with_accumulation_equals_eager(tiny_llama):
    # two micro batches per step: the accumulate graph and the update graph, each compiled once
    cfg = override(tiny_llama, ["train.micro_batch_size=4", "train.global_batch_size=8"])
    eager, _ = run_steps(override(cfg, ["train.compile=false"]), 4)
    counters.clear()
    compiled, _ = run_steps(cfg, 4)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert counters["stats"]["unique_graphs"] == 2


def test_accumulation_equals_one_large_micro_batch(tiny_gpt):
    base = override(tiny_gpt, ["train.compile=false", "train.global_batch_size=8"])
    one, run_one = run_steps(override(base, ["train.micro_batch_size=8"]), 4)
    four, run_four = run_steps(override(base, ["train.micro_batch_size=2"]), 4)
    torch.testing.assert_close(four, one, rtol=1e-5, atol=0)
    for a, b in zip(tree.leaves(run_four.params), tree.leaves(run_one.params)):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
