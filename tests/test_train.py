"""End to end: learning on the real corpus, the command line, logs, checkpoints and resume."""

import json
import math
import re

import pytest
import torch

from fxmega.cli import main
from fxmega.config import override
from fxmega.core import tree
from fxmega.data.corpus import ensure_shakespeare
from fxmega.storage import checkpoint
from fxmega.training.run import Run
from tests.conftest import ROOT

# the prose and verse characters: what a model that learned the corpus samples almost only
PROSE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:'!?-\n")


@pytest.mark.slow
def test_make_run_learns_and_ends_with_a_sample(tmp_path, capsys):
    """``make run``'s config and command, scaled to seconds (the tiny GPT's size, 150 eager
    steps): the validation loss falls below the corpus' byte unigram entropy, and the run
    ends by printing its sample, which reads like the corpus."""
    ensure_shakespeare(ROOT / "data")
    log = tmp_path / "log.jsonl"
    small = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
             f"data.data_dir={ROOT / 'data'}", "train.sample_tokens=200"]
    assert main(["--config", str(ROOT / "configs/shakespeare_gpt.py"), "--no-compile", "--no-progress",
                 "--steps", "150", "--micro-batch-size", "16", "--global-batch-size", "16", "--seq-length", "64",
                 "--lr-warmup-iters", "10", "--eval-iters", "8", "--eval-interval", "150", "--log-jsonl", str(log),
                 "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
                 *[w for s in small for w in ("--set", s)]]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # the corpus' byte unigram entropy is 3.33 nats; uniform over 256 bytes is 5.55
    assert records[-1]["valid_loss"] < 2.9, records[-1]
    assert records[-1]["loss"] < records[0]["loss"] - 2
    out = capsys.readouterr().out
    block = out[out.rindex("-" * 30 + " sample " + "-" * 30):]
    sample = block.split("\n", 1)[1].rsplit("\n" + "-" * 68, 1)[0]
    assert out.rstrip().endswith("-" * 68) and sample.startswith("ROMEO.\n")  # the last thing said
    text = sample.removeprefix("ROMEO.\n")
    assert 150 <= len(text) <= 200, len(text)  # 200 byte-level tokens, a few undecodable bytes dropped
    # an untrained model samples such characters at 60/256 = 23%; this one almost only them
    assert sum(c in PROSE for c in text) / len(text) > 0.9, text


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


def test_the_progress_bar_names_the_step_of_its_loss_and_never_shows_a_zero_rate(tmp_path, capsys):
    # between log lines no step is read: the loss shown is the last one read, labelled with
    # its step, and the token rate is the host's, updated every step (it read tok_s=0 before)
    assert main(["--config", str(ROOT / "configs/tiny_gpt.py"), "--mock-data", "--no-compile", "--steps", "6",
                 "--log-interval", "100"]) == 0
    bar = capsys.readouterr().err.replace("\r", "\n")
    renders = [line for line in bar.splitlines() if line.startswith("train:")]
    assert any("loss@1=" in r for r in renders), bar
    assert "loss@6=" in renders[-1] and "6/6" in renders[-1], renders[-1]
    assert not re.search(r"tok_s=0(?![\d.,])", bar), bar
    assert re.search(r"tok_s=[1-9]", renders[-1]), renders[-1]


def test_an_async_save_is_announced_when_it_is_committed(tmp_path, capsys):
    saver = checkpoint.Checkpointer(tmp_path, async_save=True)
    saver.save(1, {"w": torch.ones(4)}, {"step": 1})
    assert "saved checkpoint" not in capsys.readouterr().out  # only a .tmp_ directory so far: a SIGKILL loses it
    assert checkpoint.latest(tmp_path) is None
    saver.wait()
    assert f"step 1: saved checkpoint {checkpoint.step_dir(tmp_path, 1)}" in capsys.readouterr().out
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 1)
