"""Checkpoints: exact resume in a new process, atomic saves that survive SIGKILL, clear
errors for damaged files, no unsafe unpickling, retention, asynchronous saves, and
loading onto another mesh (dp2×tp2 → 1, tp2×pp2 → dp4, 1 → tp2, a MoE's ep=2 → ep=4 and 1)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from fxmega.cli import main
from fxmega.config import override
from fxmega.core import tree
from fxmega.core.errors import CheckpointError
from fxmega.storage import checkpoint
from fxmega.storage.checkpoint_files import MANIFEST, digests, write_manifest
from fxmega.training.run import Run
from tests.checkpoint_workers import config
from tests.commands import env, run_py
from tests.conftest import ROOT
from tests.multirank import run_ranks
from tests.tolerance import assert_losses_match

SHAKESPEARE = ["--set", "data.source=shakespeare", "--set", f"data.data_dir={ROOT / 'data'}"]
CLI = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), *SHAKESPEARE, "--no-compile", "--no-progress",
       "--steps", "6", "--log-interval", "1"]


def _losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def _cli(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, **kw)


@pytest.mark.slow
def test_resume_in_a_new_process_continues_bit_identically(tmp_path):
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    assert main([*CLI, "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--log-jsonl", str(straight)]) == 0
    proc = _cli([*CLI, "--load", str(tmp_path / "ckpt" / "step_00000003"), "--log-jsonl", str(resumed)])
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "at step 3" in out
    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in b)  # bitwise: same data order, same state


@pytest.fixture
def saved(tmp_path, tiny_gpt):
    run = Run(override(tiny_gpt, ["train.compile=false"]))
    for _ in range(2):
        run.do_step()
        run.save(str(tmp_path / "ckpt"))
    return tmp_path / "ckpt", run


@pytest.mark.slow
def test_a_save_killed_before_its_rename_leaves_the_last_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    proc = _cli([*CLI, "--save", str(root), "--save-interval", "2"],
                env={"FXMEGA_TEST_PAUSE_BEFORE_RENAME": "4:60"})
    deadline = time.monotonic() + 240
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "pausing before the rename" in line:
            break
    else:
        proc.kill()
        pytest.fail("the save never reached the pause:\n" + "".join(lines[-30:]))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (root / ".tmp_step_00000004").is_dir()  # the killed save, never renamed
    assert checkpoint.latest(root).name == "step_00000002"
    run = Run(override(_tiny(), ["data.source=shakespeare", f"data.data_dir={ROOT / 'data'}"]))
    assert run.resume(str(root)) and run.step == 2
    # the next save that commits removes the half-written one (as large as a checkpoint)
    run.do_step()
    run.save(str(root))
    run.finish_saves()
    assert checkpoint.latest(root).name == "step_00000003"
    assert not any(p.name.startswith(".tmp_") for p in root.iterdir())


def _tiny():
    from fxmega.config import load

    return override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.compile=false"])


def test_damaged_checkpoints_are_clear_errors(saved):
    root, run = saved
    step = checkpoint.latest(root)
    data = next(step.glob("__0_*.distcp"))
    original = data.read_bytes()
    fresh = Run(_tiny())

    data.write_bytes(original[:-100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has [\d,]+ bytes, the manifest says .*truncated"):
        fresh.resume(str(root))
    data.write_bytes(original[:50] + bytes([original[50] ^ 0xFF]) + original[51:])
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        fresh.resume(str(root))
    data.unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        fresh.resume(str(root))
    data.write_bytes(original)
    (step / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: it is not a complete fxmega checkpoint"):
        fresh.resume(str(root))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_that_names_foreign_code_is_refused(saved):
    root, _ = saved
    step = checkpoint.latest(root)
    (step / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    names = json.loads((step / MANIFEST).read_text())["files"]
    write_manifest(step, digests(step, sorted(names)))  # the attacker also fixes the manifest
    with pytest.raises(CheckpointError, match=r"refers to (posix|os)\.system, which DCP never writes"):
        Run(_tiny()).resume(str(root))


@pytest.mark.parametrize(("name", "content", "says"), [
    (MANIFEST, b"0", r"holds an integer \(0\) where an object belongs"),
    (MANIFEST, b"[]", r"holds an array \(\[\]\) where an object belongs"),
    (MANIFEST, b'{"files": 3}', r"field 'files' is an integer \(3\), it must be an object"),
    (MANIFEST, b'{"nope": {}}', r"has no field 'files'"),
    (MANIFEST, b'{"files": {"../../etc/passwd": {"bytes": 1, "crc32": 0}}}', r"not a file name inside"),
    (MANIFEST, b'{"files": {"meta.json": {"bytes": "9", "crc32": 0}}}', r"field 'bytes' is a string"),
    (MANIFEST, b"\xff\xfe", r"cannot be read as UTF-8 text"),
    ("meta.json", b"0", r"meta.json holds an integer"),
    ("meta.json", b"{}", r"meta.json has no field 'step'"),
    ("meta.json", b'{"step": true}', r"field 'step' is a boolean \(true\), it must be an integer"),
    ("meta.json", b'{"step": 1, "config": {"model": 5}}', r"config.model is not an object"),
    (".metadata", pickle.dumps(0), r"unpickles to int, not DCP's Metadata"),
])
def test_files_of_the_wrong_shape_are_checkpoint_errors(tmp_path, name, content, says):
    """What the fuzz test once found (manifest.json holding 0 gave a TypeError), for every
    file a checkpoint holds: valid JSON or pickle of the wrong shape is a CheckpointError."""
    step = checkpoint.save(tmp_path, 1, {"params.w": torch.ones(4)}, {"step": 1})
    (step / name).write_bytes(content)
    if name != MANIFEST:  # the manifest is rewritten too, so the shape check (not the CRC) must catch it
        write_manifest(step, digests(step, sorted(json.loads((step / MANIFEST).read_text())["files"])))
    with pytest.raises(CheckpointError, match=says):
        checkpoint.check(step)
        checkpoint.saved_shapes(step)


def test_keep_last_retires_old_checkpoints(tmp_path):
    run = Run(_tiny())
    run.cfg = override(run.cfg, ["train.keep_last=2"])
    for _ in range(4):
        run.do_step()
        run.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert checkpoint.latest(tmp_path).name == "step_00000004"


def test_async_save_writes_the_same_checkpoint(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        run = Run(override(_tiny(), [f"train.async_save={mode == 'async'}"]))
        for _ in range(3):
            run.do_step()
            run.save(str(tmp_path / mode))
            run.do_step()  # training goes on while the async save is written
        run.finish_saves()
        runs[mode] = Run(_tiny())
        assert runs[mode].resume(str(tmp_path / mode)) and runs[mode].step == 5
    for a, b in zip(tree.leaves(runs["sync"].params), tree.leaves(runs["async"].params)):
        assert torch.equal(a, b)
    assert runs["sync"].do_step()["loss"] == runs["async"].do_step()["loss"]


def test_params_only_load_starts_the_optimizer_fresh(saved):
    root, trained = saved
    run = Run(_tiny())
    assert run.resume(str(root), params_only=True) and run.step == 0
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(run.params), tree.leaves(trained.params)))
    assert float(run.opt_state["step"]) == 0 and all(float(m.abs().sum()) == 0 for m in run.opt_state["exp_avg"])


@pytest.mark.slow
def test_a_checkpoint_resumes_with_the_optimizer_it_was_trained_with(tmp_path):
    """``run.py --optimizer muon --save M``, then ``--load M`` without ``--optimizer``: it
    resumes as Muon, says so, and continues bit for bit as a straight Muon run (before, it
    trained on as AdamW with Muon's momentum as the first moment). Asking for AdamW is refused
    naming both; ``--finetune`` takes the parameters and starts AdamW fresh. Eager: the choice
    is made before anything is compiled."""
    common = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mock-data", "--no-compile", "--no-progress",
              "--log-interval", "1", "--lr-decay-iters", "4"]
    ckpt, log, straight = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "straight.jsonl"
    run_py(*common, "--optimizer", "muon", "--steps", "4", "--log-jsonl", str(straight))
    run_py(*common, "--optimizer", "muon", "--steps", "2", "--save", str(ckpt), "--log-jsonl", str(log))
    resumed = run_py(*common, "--steps", "4", "--load", str(ckpt), "--log-jsonl", str(log))
    assert f"resuming with muon, the optimizer {ckpt} was trained with" in resumed.stdout + resumed.stderr
    losses = lambda path: [json.loads(line)["loss"] for line in path.read_text().splitlines()]  # noqa: E731
    assert losses(log) == losses(straight)
    refused = subprocess.run([sys.executable, str(ROOT / "run.py"), *common, "--optimizer", "adamw", "--steps", "4",
                              "--load", str(ckpt)], capture_output=True, text=True, timeout=300, env=env())
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in said, said[-3000:]
    assert f"--load {ckpt} was trained with muon; this run asks for adamw" in said and "--finetune" in said
    fresh = run_py(*common, "--optimizer", "adamw", "--finetune", "--steps", "1", "--load", str(ckpt))
    assert "initialised the parameters from" in fresh.stdout + fresh.stderr


def test_a_run_of_another_optimizer_does_not_read_the_state(saved):
    root, _ = saved  # trained with AdamW
    with pytest.raises(CheckpointError, match="trained with adamw and this run uses muon"):
        Run(override(_tiny(), ["optim.optimizer=muon"])).resume(str(root))


def test_a_checkpoint_of_another_model_is_a_clear_error(saved):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"has shape \[64, 64\], this model's is \[64, 32\]|different model"):
        Run(override(_tiny(), ["model.d_model=32"])).resume(str(root))


# -- loading onto another mesh --------------------------------------------------------------
def _single(root=None, save_at: int = 3, model: str = "tiny_gpt") -> list[float]:
    run = Run(config(None, model))
    if root is not None:
        assert run.resume(str(root)) and run.step == save_at
        return [run.do_step()["loss"] for _ in range(6 - save_at)]
    return [run.do_step()["loss"] for _ in range(6)]


@pytest.mark.slow
def test_dp2_tp2_checkpoint_continues_on_one_device(tmp_path):
    r = run_ranks(4, "tests.checkpoint_workers:save_then_load", dict(mesh="dp=2,tp=2", rules="zero1"),
                  str(tmp_path), 3)[0]
    # steps 4-6 on one device against the 4-rank run that saved at step 3: other summation orders
    assert_losses_match(_single(tmp_path), r["saved_run"][3:], config(None), first_step=4)


@pytest.mark.slow
def test_tp2_pp2_checkpoint_continues_on_dp4(tmp_path):
    r = run_ranks(4, "tests.checkpoint_workers:save_then_load", dict(mesh="tp=2,pp=2", sequence_parallel=True),
                  str(tmp_path), 3, dict(mesh="dp=4", rules="zero1"))[0]
    assert_losses_match(r["loaded_run"], r["saved_run"][3:], config(None), first_step=4)


@pytest.mark.slow
def test_cp4_checkpoint_continues_on_dp2_cp2(tmp_path):
    # context parallelism leaves the checkpoint as it is (parameters replicated over cp): a
    # run saved on cp=4 continues on dp=2 x cp=2, the sequence now in 4 chunks instead of 8
    r = run_ranks(4, "tests.checkpoint_workers:save_then_load", dict(mesh="cp=4"), str(tmp_path), 3,
                  dict(mesh="dp=2,cp=2"))[0]
    assert_losses_match(r["loaded_run"], r["saved_run"][3:], config(None), first_step=4)


@pytest.mark.slow
def test_ep2_checkpoint_continues_on_ep4_and_on_one_device(tmp_path):
    # a MoE run's experts split over ep=2 (their AdamW state further over the 2 expert-data
    # ranks, ZeRO-1) read back as one expert per rank (ep=4) and as whole tensors (one device)
    r = run_ranks(4, "tests.checkpoint_workers:save_then_load", dict(mesh="dp=4,ep=2", rules="zero1"),
                  str(tmp_path), 3, dict(mesh="dp=4,ep=4"), "tiny_moe")[0]
    assert_losses_match(r["loaded_run"], r["saved_run"][3:], config(None, "tiny_moe"), first_step=4)
    assert_losses_match(_single(tmp_path, model="tiny_moe"), r["saved_run"][3:], config(None, "tiny_moe"),
                        first_step=4)


@pytest.mark.slow
def test_single_device_checkpoint_continues_on_tp2(tmp_path):
    run = Run(config(None))
    straight = []
    for step in range(6):
        straight.append(run.do_step()["loss"])
        if step == 2:
            run.save(str(tmp_path))
    r = run_ranks(2, "tests.checkpoint_workers:save_then_load", None, str(tmp_path), 3, dict(mesh="tp=2"))[0]
    assert_losses_match(r["loaded_run"], straight[3:], config(None), first_step=4)
