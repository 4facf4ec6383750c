"""`run.py eval`: loss and perplexity of a checkpoint on held-out data, the same on one device
and on a sharded mesh; perplexity is exp(mean loss)."""

import json
import math
import os
import subprocess
import sys

import pytest

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.tolerance import run_rtol

ARGS = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mock-data", "--no-compile", "--micro-batch-size", "4",
        "--eval-iters", "3"]  # flags that train and eval both take


@pytest.mark.slow
def test_eval_of_a_checkpoint_on_one_device_and_on_tp2(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main([*ARGS, "--no-progress", "--steps", "5", "--save", str(ckpt)]) == 0
    single = tmp_path / "single.jsonl"
    assert main(["eval", *ARGS, "--load", str(ckpt), "--log-jsonl", str(single)]) == 0
    result = json.loads(single.read_text())
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert result["tokens"] == 3 * 8 * 32

    # the same number as the trained run's own evaluation
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["data.source=mock", "train.compile=false", "train.micro_batch_size=4", "train.eval_iters=3"])
    run = Run(cfg)
    assert run.resume(str(ckpt))
    # the same forward over the same batches; summed per micro batch in another grouping
    assert result["loss"] == pytest.approx(run.evaluate(), rel=run_rtol(cfg, 1))

    sharded = tmp_path / "tp2.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "eval", *ARGS, "--load", str(ckpt), "--mesh", "tp=2",
                           "--log-jsonl", str(sharded)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "perplexity" in proc.stdout
    assert json.loads(sharded.read_text())["loss"] == pytest.approx(result["loss"], rel=run_rtol(cfg, 1))  # tp's orders


@pytest.mark.slow
def test_eval_writes_where_its_command_says_never_into_the_training_log(tmp_path):
    """A checkpoint records its run's ``--log-jsonl`` (a relative path here): ``run.py eval
    --load`` from another directory neither appends a step-less record to that training log
    nor fails looking for it; with ``--log-jsonl`` it writes there, and a directory that does
    not exist is refused before evaluating."""
    train_dir, elsewhere = tmp_path / "train", tmp_path / "elsewhere"
    train_dir.mkdir(), elsewhere.mkdir()
    run_py = [sys.executable, str(ROOT / "run.py")]
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*run_py, *ARGS, "--no-progress", "--steps", "2", "--save", "ckpt", "--log-jsonl", "log.jsonl"],
                   cwd=train_dir, env=environ, check=True, capture_output=True, timeout=600)
    logged = (train_dir / "log.jsonl").read_text()
    for cwd in (train_dir, elsewhere):
        proc = subprocess.run([*run_py, "eval", "--load", str(train_dir / "ckpt"), "--mock-data", "--eval-iters", "2"],
                              cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "perplexity" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (train_dir / "log.jsonl").read_text() == logged and not (elsewhere / "log.jsonl").exists()
    proc = subprocess.run([*run_py, "eval", "--load", str(train_dir / "ckpt"), "--mock-data", "--eval-iters", "2",
                           "--log-jsonl", "eval.jsonl"], cwd=elsewhere, env=environ, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "perplexity" in json.loads((elsewhere / "eval.jsonl").read_text())
    proc = subprocess.run([*run_py, "eval", "--load", str(train_dir / "ckpt"), "--mock-data", "--log-jsonl",
                           "missing/eval.jsonl"], cwd=elsewhere, env=environ, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "--log-jsonl missing/eval.jsonl: its directory does not exist" in proc.stderr


def test_eval_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", *ARGS]) == 2
    assert "eval needs a checkpoint: --load CKPT" in capsys.readouterr().err
    assert main(["eval", *ARGS, "--load", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
