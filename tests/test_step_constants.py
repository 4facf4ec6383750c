"""What attention reads that no layer changes — rotary tables, the padding mask — is built
once per step (``attend_inputs``) and given to every block, not rebuilt per layer, nor
again when a block is recomputed in the backward.

The step is traced with ``make_fx`` in a subprocess: traced in the test process, a later
test's aot_autograd partition failed ('>' between None in the min-cut partitioner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmega.config import load, override
from fxmega.core import tree
from fxmega.training.run import Run

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 3
CASES = [(mode, padded) for mode in ("none", "full") for padded in (False, True)]


def _ops_of_step(mode: str, padded: bool) -> Counter:
    cfg = override(load(ROOT / "configs" / "tiny_llama.py"),
                   ["train.compile=false", "train.device=cpu", f"compute.recompute={mode}",
                    f"model.n_layers={LAYERS}"])
    run = Run(cfg)
    flat = tree.leaves(run.params)
    batch = run.train_data.global_batch(0, cfg.train.global_batch_size)
    if padded:  # the last quarter of every row is padding
        valid = torch.ones_like(batch["inputs"])
        valid[:, -valid.shape[1] // 4:] = 0
        batch = {**batch, "attention_mask": valid}

    def step(flat: list[torch.Tensor], batch: dict) -> tuple:
        return torch.autograd.grad(run.loss_sum(flat, batch), flat)

    graph = make_fx(step)(flat, batch)  # forward and backward, recomputation included
    return Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")


@pytest.fixture(scope="module")
def traced() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {tuple(k.split(",")): Counter(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("mode,padded", CASES)
def test_rotary_tables_and_masks_are_built_once_per_step(traced, mode, padded):
    ops = traced[(mode, str(padded))]
    # per layer (and again per recomputed layer) these would count LAYERS or 2 x LAYERS
    assert ops["aten.cos.default"] == 1, ops
    assert ops["aten.sin.default"] == 1, ops
    # the mask's causal order (query position >= key position): its one comparison of that kind
    assert ops["aten.ge.Tensor"] == (1 if padded else 0), ops
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] + ops[
        "aten._scaled_dot_product_attention_math.default"] + ops[
        "aten.scaled_dot_product_attention.default"] >= LAYERS, ops  # every layer still attends


if __name__ == "__main__":
    print(json.dumps({f"{m},{p}": _ops_of_step(m, p) for m, p in CASES}))
