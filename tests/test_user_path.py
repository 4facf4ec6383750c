"""The commands users type, run as they type them: `run.py ... --mesh M` as a subprocess,
with the default compiler (inductor), through training, evaluation, save, resume and
generation."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _run_py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_the_docs_zero3_command_trains_evaluates_saves_resumes_and_generates(tmp_path):
    # docs/parallelism.md's command, shrunk in steps, on a corpus so that generation has a tokenizer
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", "dp=2", "--rules", "zero3",
            "--micro-batch-size", "4", "--data-path", str(corpus), "--no-progress", "--save", str(ckpt),
            "--log-jsonl", str(log), "--log-interval", "1", "--eval-interval", "2"]
    first = _run_py(*args, "--steps", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "step 2: validation loss" in first.stdout  # evaluation under ZeRO-3 crashed in dynamo before
    resumed = _run_py(*args, "--steps", "4", "--load", str(ckpt))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    records = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the resumed run went on from step 2
    assert "valid_loss" in records[3]
    gen = _run_py("generate", "--load", str(ckpt), "--mesh", "dp=2", "--rules", "zero3", "--prompt", "the quick",
                  "--max-new-tokens", "8", "--temperature", "0")
    assert gen.returncode == 0, gen.stdout[-3000:] + gen.stderr[-3000:]
    assert "the quick" in gen.stdout
