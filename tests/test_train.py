"""End to end: learning on the real corpus, the command line, logs, checkpoints and resume."""

import json
import math

import pytest
import torch

from fxmega.cli import main
from fxmega.config import override
from fxmega.core import tree
from fxmega.data.corpus import ensure_shakespeare
from fxmega.storage import checkpoint
from fxmega.training.run import Run
from fxmega.training.train import train
from tests.conftest import ROOT


@pytest.mark.slow
def test_loss_falls_below_unigram_entropy_on_shakespeare(tiny_gpt):
    ensure_shakespeare(ROOT / "data")
    cfg = override(tiny_gpt, ["data.source=shakespeare", f"data.data_dir={ROOT / 'data'}", "train.compile=false",
                              "train.steps=150", "train.micro_batch_size=16", "train.global_batch_size=16",
                              "train.seq_len=64", "optim.lr=3e-3", "optim.warmup_steps=10", "train.eval_iters=8"])
    result = train(cfg, progress=False)
    # the corpus' byte unigram entropy is 3.33 nats; uniform over 256 bytes is 5.55
    assert result.valid_losses[150] < 2.9, result.valid_losses
    assert result.losses[-1] < result.losses[0] - 2


def test_cli_run_writes_jsonl_and_checkpoint(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code = main(["--config", str(ROOT / "configs/tiny_gpt.py"), "--mock-data", "--no-compile", "--no-progress",
                 "--steps", "4", "--log-jsonl", str(log), "--save", str(tmp_path / "ckpt"), "--log-interval", "2"])
    assert code == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r)
        assert math.isfinite(r["loss"])
    assert "valid_loss" in records[-1]
    assert checkpoint.latest(tmp_path / "ckpt").name == "step_00000004"
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out


def test_resume_continues_bit_identically(tiny_gpt, tmp_path):
    cfg = override(tiny_gpt, ["train.compile=false", "train.steps=6"])
    straight = Run(cfg)
    expected = [straight.do_step()["loss"] for _ in range(6)]

    first = Run(cfg)
    losses = [first.do_step()["loss"] for _ in range(3)]
    first.save(str(tmp_path))
    second = Run(cfg)  # a fresh run, as a new process would build it
    assert second.resume(str(tmp_path)) and second.step == 3
    losses += [second.do_step()["loss"] for _ in range(3)]
    assert losses == expected
    for a, b in zip(tree.leaves(second.params), tree.leaves(straight.params)):
        assert torch.equal(a, b)
