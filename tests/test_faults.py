"""Surviving faults: a rank killed mid-run under torchrun --max-restarts comes back and
resumes from the newest complete checkpoint with the loss of an uninterrupted run; runs are
bitwise deterministic; the launch examples for Slurm and Kubernetes are well-formed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from fxmega.cli import config_from_args, main, parse_args
from tests.conftest import ROOT
from tests.tolerance import run_rtol

ARGS = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mock-data", "--no-progress", "--no-compile",
        "--steps", "6", "--micro-batch-size", "4", "--log-interval", "1"]


def _cfg():
    """The run ARGS describe, for its rounding tolerance."""
    return config_from_args(parse_args(ARGS))


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    straight = tmp_path / "straight.jsonl"
    assert main([*ARGS, "--log-jsonl", str(straight)]) == 0
    ckpt, log = tmp_path / "ckpt", tmp_path / "restarted.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(ROOT / "run.py"), *ARGS, "--mesh", "dp=2", "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", "2", "--log-jsonl", str(log), "--set", "parallel.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXMEGA_TEST_KILL_AT_STEP": "1:5"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "fault injection: killing rank 1 after step 5" in out
    assert "resumed from" in out and "at step 4" in out  # the newest complete checkpoint
    records = _records(log)
    # rank 0 finished and logged step 5 before rank 1 died; the restarted group redid it
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 6]
    assert records[4]["loss"] == records[5]["loss"]
    want = {r["step"]: r["loss"] for r in _records(straight)}
    # steps 5 and 6 on dp=2 against one device: other summation orders
    assert [r["loss"] for r in records[5:]] == pytest.approx([want[5], want[6]], rel=run_rtol(_cfg(), 6))


@pytest.mark.slow
def test_two_runs_with_the_same_seed_are_bitwise_identical(tmp_path):
    import torch

    logs = []
    try:
        for i in range(2):
            logs.append(tmp_path / f"run{i}.jsonl")
            assert main([*ARGS, "--deterministic", "--log-jsonl", str(logs[-1])]) == 0
    finally:
        torch.use_deterministic_algorithms(True, warn_only=True)  # the suite's setting (conftest.py)
    a, b = _records(logs[0]), _records(logs[1])
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


def test_slurm_example_is_valid_bash():
    script = ROOT / "examples" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --nodes" in text and "torchrun" in text and "--max-restarts" in text and "--load" in text


def test_kubernetes_example_is_a_pytorchjob():
    job = yaml.safe_load((ROOT / "examples" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["apiVersion"].startswith("kubeflow.org/")
    specs = job["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Worker"):
        container = specs[role]["template"]["spec"]["containers"][0]
        assert container["command"] == ["torchrun"] and "run.py" in container["args"]
        assert any(a.startswith("--load=") for a in container["args"])


# -- numerical faults -------------------------------------------------------------------
def _tiny(*extra):
    from fxmega.config import load, override

    # aot_eager: the guard is graph logic (the same AOTAutograd graph inductor would fuse), and
    # inductor's kernels for this step are checked by the compiled-equals-eager tests
    return override(load(ROOT / "configs" / "tiny_gpt.py"),
                    ["train.compile=true", "train.compile_backend=aot_eager", *extra])


@pytest.mark.slow
def test_nonfinite_step_is_skipped_inside_the_compiled_step(monkeypatch):
    import torch
    from torch._dynamo.utils import counters

    from fxmega.core import tree
    from fxmega.training.run import Run

    monkeypatch.setenv("FXMEGA_TEST_NAN_AT_STEP", "3")
    run = Run(_tiny("train.nonfinite=skip"))
    counters.clear()
    results = [run.do_step() for _ in range(2)]
    before = [t.detach().clone() for t in tree.leaves(run.params)]
    moments = [m.clone() for m in run.opt_state["exp_avg_sq"]]
    results.append(run.do_step())  # NaN loss and gradients
    assert results[-1]["skipped"] and run.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tree.leaves(run.params)))  # nothing applied
    assert all(torch.equal(a, b) for a, b in zip(moments, run.opt_state["exp_avg_sq"]))
    assert float(run.opt_state["step"]) == 2  # the optimizer's step count did not move
    results += [run.do_step() for _ in range(2)]
    assert all(not r.get("skipped") and r["loss"] == r["loss"] for r in results[3:])  # training goes on, finite
    assert counters["stats"]["unique_graphs"] == 1  # the guard lives in the one graph


def test_nonfinite_step_stops_with_diagnostics(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FXMEGA_TEST_NAN_AT_STEP", "2")
    code = main([*ARGS, "--set", f"train.diagnostics_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "step 2: non-finite loss or gradient" in err and "Traceback" not in err
    report = json.loads((tmp_path / "nonfinite_step00000002_rank0.json").read_text())
    assert report["step"] == 2 and report["rank"] == 0 and "embed.tokens" in report["nonfinite_gradients"]


def test_nonfinite_stop_between_log_steps_names_the_step(monkeypatch, tmp_path, capsys):
    # the loop reads the device only at log steps: step 3 goes bad, the read at step 4 stops the run, naming step 3
    monkeypatch.setenv("FXMEGA_TEST_NAN_AT_STEP", "3")
    log = tmp_path / "log.jsonl"
    code = main([*ARGS, "--log-interval", "4", "--log-jsonl", str(log), "--set", f"train.diagnostics_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "step 3: non-finite loss or gradient" in err, err
    assert json.loads((tmp_path / "nonfinite_step00000003_rank0.json").read_text())["step"] == 3
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1]  # nothing reported past it


def test_bad_gradient_is_named_and_a_dropped_update_changes_nothing():
    import torch

    from fxmega.optim.adamw import AdamWHyper, adamw_init, adamw_update
    from fxmega.training.optim import per_tensor_norms

    grads = [torch.ones(3), torch.tensor([1.0, float("nan")]), torch.full((2,), float("inf"))]
    assert (~torch.isfinite(per_tensor_norms(grads))).tolist() == [False, True, True]
    params = [torch.randn(3), torch.randn(2), torch.randn(2)]
    state = adamw_init(params)
    snapshot = [p.clone() for p in params]
    adamw_update(params, grads, state, torch.tensor(0.1), AdamWHyper(0.9, 0.95, 1e-8, 0.1), [True] * 3,
                 apply=torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(params, snapshot)) and float(state["step"]) == 0
    assert all(float(m.abs().sum()) == 0 for m in state["exp_avg"] + state["exp_avg_sq"])


def test_loss_spike_detector():
    from fxmega.training.faults import SpikeDetector

    detector = SpikeDetector(z=6.0)
    assert all(detector.score(3.0 + 0.01 * (i % 3)) is None for i in range(20))
    assert detector.score(3.5) > 6  # far above a steady loss
    assert SpikeDetector(z=0).score(100.0) is None  # disabled


# -- hangs and stragglers -----------------------------------------------------------------
def _run_two_ranks(env: dict, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    import time

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *ARGS, "--mesh", "dp=2", *extra], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                          timeout=300)
    return proc, time.monotonic() - t0


@pytest.mark.slow
def test_a_stalled_rank_is_named_within_the_timeout():
    # rank 1 stops answering before step 3 (a sick host); rank 0's collective gives up after
    # 8 s and says who it waited for, on which mesh axis, and what the backend reported
    proc, seconds = _run_two_ranks({"FXMEGA_TEST_STALL_AT_STEP": "1:3:40"}, "--set", "parallel.timeout_s=8")
    assert proc.returncode != 0
    assert "error: rank 0 (dp=0) timed out in step 3 waiting for rank 1 (dp=1), still at step 2" in proc.stderr
    assert "mesh axis dp" in proc.stderr and "the backend reports" in proc.stderr
    assert seconds < 40, f"took {seconds:.0f} s: the failure did not come within the timeout"


@pytest.mark.slow
def test_the_straggler_is_named_in_the_log():
    proc, _ = _run_two_ranks({"FXMEGA_TEST_STALL_AT_STEP": "1:4:0.5"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[rank 0] step      4 |"))
    assert "straggler: rank 1 began the step" in line
