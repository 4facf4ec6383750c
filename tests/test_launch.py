"""`python run.py --mesh 2x2` starts 4 local processes through torch.distributed's launcher
and trains with the losses of `--mesh 1`; errors stay one readable line."""

import json
import os
import subprocess
import sys

import pytest

from fxmega.cli import config_from_args, main, parse_args
from fxmega.core.errors import ConfigError
from fxmega.planning.capacity import RANK_PROCESS_BYTES, Machine, check_capacity
from fxmega.sharding.mesh import MeshSpec
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


# -- before any rank starts: every check in the launching process, one line, exit 2 ---------

def _run_py(*args: str, timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, extra, message", [
    ("3x5x7", (), "7 pipeline stages need at least 7 blocks, but the model has 2"),
    ("dp=3,tp=3", (), "dim 2 (heads) has size 4, which tp=3 does not divide"),
    ("dp=2", ("--global-batch-size", "8", "--micro-batch-size", "8"),
     "train.global_batch_size=8 is not a multiple of train.micro_batch_size=8 x data-parallel size 2 = 16"),
])
def test_a_mesh_that_cannot_run_is_one_line_before_any_rank_starts(mesh, extra, message):
    proc = _run_py("--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", mesh, *extra)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert message in lines[0] and "starting" not in lines[0]


@pytest.mark.slow
def test_a_mesh_this_machine_cannot_hold_is_refused_before_it_starts():
    world = 4 * len(os.sched_getaffinity(0)) + 2  # past the ranks-per-core limit on any machine
    proc = _run_py("--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", f"dp={world}",
                   "--global-batch-size", str(world), "--micro-batch-size", "1")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert f"would start {world} local processes" in lines[0]
    assert "torchrun --nnodes" in lines[0] and "--oversubscribe" in lines[0]


def test_capacity_counts_cores_memory_and_gpus():
    gib = 2**30
    check_capacity(MeshSpec.parse("dp=8"), "dp=8", "cpu", 0, Machine(cores=2, available_bytes=24 * gib, gpus=0))
    with pytest.raises(ConfigError, match=r"would start 9 local processes.*room for 8 ranks"):
        check_capacity(MeshSpec.parse("dp=9"), "dp=9", "cpu", 0, Machine(cores=2, available_bytes=24 * gib, gpus=0))
    # memory: each rank is the process plus what the plan puts on it
    per_rank = RANK_PROCESS_BYTES + gib
    with pytest.raises(ConfigError, match=r"room for 3 ranks"):
        check_capacity(MeshSpec.parse("dp=4"), "dp=4", "cpu", gib,
                       Machine(cores=64, available_bytes=3 * per_rank + 1, gpus=0))
    with pytest.raises(ConfigError, match=r"needs 4 GPUs, one per rank, and this machine has 2"):
        check_capacity(MeshSpec.parse("2x2"), "2x2", "cuda", 0, Machine(cores=64, available_bytes=64 * gib, gpus=2))


@pytest.mark.slow
def test_a_rank_error_is_printed_once_without_the_launchers_traceback(tmp_path):
    # a data path only the ranks read: both ranks fail the same way
    proc = _run_py("--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", "dp=2", "--micro-batch-size", "4",
                   "--no-compile", "--data-path", str(tmp_path / "missing.txt"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count("is neither a text file nor the prefix of an indexed dataset") == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out


@pytest.mark.slow
def test_ranks_that_lose_their_launcher_each_say_so_in_one_line(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *ARGS, "--no-compile", "--mesh", "dp=2", "--steps", "1000000",
         "--log-interval", "100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    for line in launcher.stdout:  # the ranks are training once rank 0 reports its first step
        lines.append(line)
        if "first step took" in line:
            break
    launcher.kill()  # SIGKILL: no chance to stop its ranks; they hold the pipe until they exit
    out = "".join(lines) + launcher.stdout.read()
    launcher.wait()
    lost = [line for line in out.splitlines() if "the launcher's rendezvous store stopped answering" in line]
    assert sorted(line.split("]")[0] for line in lost) == ["[rank 0", "[rank 1"], out
    assert "Traceback" not in out and "frame #" not in out, out
