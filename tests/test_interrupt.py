"""An interrupted run keeps its work: SIGINT (Ctrl-C) or SIGTERM lets the current step
finish, saves it, prints one line with the command that resumes, and exits with 128 + the
signal; that command continues with the losses of a run never interrupted. A second signal
aborts at once and leaves the previous checkpoint as it was.

Each run is ``run.py`` as a subprocess with the default compiler (the mesh's, under make test,
with aot_eager). The signal is sent while
rank 0 sleeps before step 5 (``FXMEGA_TEST_STALL_AT_STEP``), so the step it stops after is
known: 5."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxmega.storage import checkpoint, checkpoint_files
from tests.conftest import ROOT
from tests.multirank import run_ranks
from tests.tiers import E2E

STEPS, STOP = 8, 5


def _args(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "--config", str(ROOT / "configs" / "tiny_gpt.py"), "--steps",
            str(STEPS), "--log-interval", "1", "--log-jsonl", str(tmp / "log.jsonl"), "--no-progress", *extra]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _wait_for(test, proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while not test():
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < end, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def _logged_steps(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _interrupted_run(tmp: Path, args: list[str], signals: list[int], env: dict[str, str],
                     before_second: str = "") -> subprocess.CompletedProcess:
    """Start ``args``, send ``signals[0]`` once step STOP - 1 is logged (rank 0 is asleep
    before step STOP), and each later one once ``before_second`` is in the output file."""
    out = tmp / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            _wait_for(lambda: _logged_steps(tmp / "log.jsonl") >= STOP - 1, proc, f"step {STOP - 1} in the log")
            proc.send_signal(signals[0])
            for s in signals[1:]:
                _wait_for(lambda: before_second in out.read_text(), proc, repr(before_second))
                proc.send_signal(s)
            proc.wait(timeout=600)
        finally:
            proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), "")


def _check_stop_and_resume(tmp: Path, args: list[str], signum: int, reference: dict[int, float],
                           env: dict[str, str]) -> None:
    stopped = _interrupted_run(tmp, args, [signum], env)
    assert stopped.returncode == 128 + signum, stopped.stdout[-3000:]
    assert "Traceback" not in stopped.stdout, stopped.stdout[-3000:]
    lines = [x for x in stopped.stdout.splitlines() if "stopped after step" in x]
    assert len(lines) == 1, stopped.stdout[-3000:]
    assert f"{signal.Signals(signum).name}: stopped after step {STOP} and saved " in lines[0]
    saved = sorted(p.name for p in (tmp / "ckpt").iterdir() if p.name.startswith("step_"))
    assert saved == [checkpoint.step_dir(tmp / "ckpt", STOP).name]  # exactly one, at the step it names
    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    resumed = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True,
                             timeout=900, env=_env())
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {checkpoint.step_dir(tmp / 'ckpt', STOP)}" in resumed.stdout
    losses = _losses(tmp / "log.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == reference  # bit-identical: the same steps, on the same process layout


@pytest.mark.slow
def test_ctrl_c_saves_the_step_it_names_and_its_resume_command_continues_unchanged(tmp_path):
    (tmp_path / "ref").mkdir(), (tmp_path / "run").mkdir()
    ref = subprocess.run(_args(tmp_path / "ref"), cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    args = _args(tmp_path / "run", "--save", str(tmp_path / "run" / "ckpt"))
    _check_stop_and_resume(tmp_path / "run", args, signal.SIGINT, _losses(tmp_path / "ref" / "log.jsonl"),
                           _env(FXMEGA_TEST_STALL_AT_STEP=f"0:{STOP}:5"))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(tmp_path):
    # the launcher's signal, the ranks' vote and the resume do not depend on the compiler: under
    # make test the ranks trace with aot_eager (tests/tiers.py), and the Ctrl-C test above stops a
    # step built by inductor; make e2e runs this one with inductor too
    mesh = ["--mesh", "dp=2", "--micro-batch-size", "4", *(() if E2E else ("--compile-backend", "aot_eager"))]
    (tmp_path / "ref").mkdir(), (tmp_path / "run").mkdir()
    ref = subprocess.run(_args(tmp_path / "ref", *mesh), cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=_env())
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    # rank 0 sleeps before step 5, rank 1 waits for it inside step 5: each learns of the
    # signal at a different point, and the vote makes them stop after the same step
    args = _args(tmp_path / "run", *mesh, "--save", str(tmp_path / "run" / "ckpt"))
    _check_stop_and_resume(tmp_path / "run", args, signal.SIGTERM, _losses(tmp_path / "ref" / "log.jsonl"),
                           _env(FXMEGA_TEST_STALL_AT_STEP=f"0:{STOP}:5"))


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_save_aborts_and_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = _args(tmp_path, "--save", str(ckpt), "--save-interval", "2")
    # the save of step 5 holds before its rename: the second Ctrl-C comes while it is half written
    aborted = _interrupted_run(tmp_path, args, [signal.SIGINT, signal.SIGINT],
                               _env(FXMEGA_TEST_STALL_AT_STEP=f"0:{STOP}:5",
                                    FXMEGA_TEST_PAUSE_BEFORE_RENAME=f"{STOP}:120"),
                               before_second="pausing before the rename")
    assert aborted.returncode == 128 + signal.SIGINT, aborted.stdout[-3000:]
    assert "Traceback" not in aborted.stdout, aborted.stdout[-3000:]
    assert sum("aborted by a second signal" in x for x in aborted.stdout.splitlines()) == 1, aborted.stdout[-3000:]
    assert checkpoint.latest(ckpt) == checkpoint.step_dir(ckpt, 4)  # the previous one, whole
    assert not checkpoint.step_dir(ckpt, STOP).exists()
    checkpoint_files.verify(checkpoint.step_dir(ckpt, 4))


def test_the_ranks_agree_to_stop_when_only_one_of_them_is_signalled():
    # a scheduler may signal one process of a job; every rank must stop after the same step
    answers = run_ranks(2, "tests.interrupt_workers:votes_with_one_rank_signalled", 5, 1, 3)
    assert answers == [[0, 0, signal.SIGTERM, signal.SIGTERM, signal.SIGTERM]] * 2
