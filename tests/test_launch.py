"""`python run.py --mesh 2x2` starts 4 local processes through torch.distributed's launcher
and trains with the losses of `--mesh 1`; errors stay one readable line."""

import json
import os
import subprocess
import sys

import pytest

from fxmega.cli import config_from_args, main, parse_args
from tests.conftest import ROOT
from tests.tolerance import run_rtol

ARGS = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mock-data", "--no-progress", "--steps", "4",
        "--micro-batch-size", "4", "--log-interval", "2"]


def _cfg(*extra: str):
    """The run ARGS describe, for its rounding tolerance."""
    return config_from_args(parse_args([*ARGS, *extra]))


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
def test_mesh_2x2_through_the_launcher_matches_one_device(tmp_path):
    single = tmp_path / "single.jsonl"
    assert main([*ARGS, "--no-compile", "--log-jsonl", str(single)]) == 0
    sharded = tmp_path / "sharded.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *ARGS, "--no-compile", "--mesh", "2x2",
                           "--sequence-parallel", "--rules", "zero1", "--log-jsonl", str(sharded),
                           "--log-level", "debug"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "starting 4 local processes" in out and "mesh: dp=2 x tp=2 (4 ranks)" in out
    # at --log-level debug every rank says where it is
    assert all(f"[rank {r}] debug: rank {r}: dp={r // 2}, tp={r % 2}" in out for r in range(4))
    assert len(_losses(sharded)) == 4  # one rank writes the log
    # the 4 steps' losses (logged every 2) on a mesh that sums in other orders
    assert _losses(sharded) == pytest.approx(_losses(single), rel=run_rtol(_cfg(), 4))


@pytest.mark.slow
def test_mesh_that_does_not_fit_the_world_is_one_clear_line(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29533"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *ARGS, "--no-compile", "--mesh", "2x2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "mesh dp=2 x tp=2 (4 ranks) needs 4 processes but the world size is 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_explain_prints_the_plan_for_a_big_mesh(capsys):
    assert main(["plan", "--config", str(ROOT / "configs" / "llama2_7b.py"), "--mesh", "dp=8,tp=4", "--rules", "zero1",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "mesh: dp=8 x tp=4 (32 ranks)" in out and "blocks.31.mlp.w_down" in out


@pytest.mark.slow
def test_mesh_2x2x2_with_a_pipeline_through_the_launcher_matches_one_device(tmp_path):
    args = [*ARGS, "--micro-batch-size", "2", "--no-compile"]  # 2 microbatches per data rank and step
    single = tmp_path / "single.jsonl"
    assert main([*args, "--log-jsonl", str(single)]) == 0
    piped = tmp_path / "piped.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args, "--mesh", "2x2x2", "--rules", "zero1",
                           "--pipeline-schedule", "gpipe", "--log-jsonl", str(piped)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh: pp=2 x dp=2 x tp=2 (8 ranks)" in proc.stdout and "stage 1 on pp rank 1: block 1, L" in proc.stdout
    assert _losses(piped) == pytest.approx(_losses(single), rel=run_rtol(_cfg("--micro-batch-size", "2"), 4))
