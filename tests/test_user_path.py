"""The commands users type, run as they type them: `run.py ... --mesh M` as a subprocess, with
the default compiler (inductor), for every strategy — the user-path matrix.

Each case trains 2 steps of a 4-step schedule with a validation pass and a save, resumes from
the save to step 4 (validating again), and generates from the checkpoint on the same mesh.
Its logged losses, gradient norms and validation losses equal the one-device run's (the same
seed and global batch, eager) within the summation-order bound of ``tests.tolerance.run_rtol``.

``make test`` runs the six riskiest cases (ZeRO-3, tp+sp, 1F1B, ring cp, ep, Muon on tp+sp); ``make e2e``
(``pytest --e2e``) runs all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxmega.cli import config_from_args, main, parse_args
from tests.commands import run_py
from tests.conftest import ROOT
from tests.tolerance import run_rtol

TINY_GPT, TINY_MOE = str(ROOT / "configs" / "tiny_gpt.py"), str(ROOT / "configs" / "tiny_moe.py")
TINY_DEEPSEEK_V3 = str(ROOT / "configs" / "tiny_deepseek_v3.py")
FOUR_BLOCKS = ("--set", "model.n_layers=4")  # two pipeline stages of two virtual stages each
MUON = ("--optimizer", "muon")
# name -> (config, the model's changes (the one-device run makes them too), the mesh's flags)
CASES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "dp": (TINY_GPT, (), ("--mesh", "dp=2", "--micro-batch-size", "4")),
    "zero1": (TINY_GPT, (), ("--mesh", "dp=2", "--zero", "1", "--micro-batch-size", "4")),
    "zero2": (TINY_GPT, (), ("--mesh", "dp=2", "--zero", "2", "--micro-batch-size", "4")),
    # docs/parallelism.md's command
    "zero3": (TINY_GPT, (), ("--mesh", "dp=2", "--rules", "zero3", "--micro-batch-size", "4")),
    "distributed_optimizer": (TINY_GPT, (), ("--mesh", "dp=2", "--zero", "1", "--use-distributed-optimizer",
                                             "--micro-batch-size", "4")),
    "fsdp": (TINY_GPT, (), ("--mesh", "fsdp=2", "--rules", "fsdp", "--micro-batch-size", "4")),
    "hsdp": (TINY_GPT, (), ("--mesh", "dp=2,fsdp=2", "--rules", "hsdp", "--micro-batch-size", "2")),
    "tp": (TINY_GPT, (), ("--mesh", "tp=2")),
    "tp_sp": (TINY_GPT, (), ("--mesh", "tp=2", "--sequence-parallel")),
    "cp_allgather": (TINY_GPT, (), ("--mesh", "cp=2", "--cp-attention", "allgather")),
    "cp_ring": (TINY_GPT, (), ("--mesh", "cp=2", "--cp-attention", "ring")),
    "cp_a2a": (TINY_GPT, (), ("--mesh", "cp=2", "--cp-attention", "a2a")),
    "ep": (TINY_MOE, (), ("--mesh", "dp=2,ep=2")),
    # DeepSeek-V3: MLA, experts with the selection bias, one MTP module, generation over the latent cache
    "deepseek_v3_ep": (TINY_DEEPSEEK_V3, (), ("--mesh", "dp=2,ep=2")),
    "pp_gpipe": (TINY_GPT, (), ("--mesh", "pp=2", "--pipeline-schedule", "gpipe", "--micro-batch-size", "4")),
    "pp_1f1b": (TINY_GPT, (), ("--mesh", "pp=2", "--pipeline-schedule", "1f1b", "--micro-batch-size", "4")),
    "pp_interleaved": (TINY_GPT, FOUR_BLOCKS, ("--mesh", "pp=2", "--pipeline-schedule", "interleaved-1f1b",
                                               "--virtual-stages", "2", "--micro-batch-size", "4")),
    "pp_zero_bubble": (TINY_GPT, (), ("--mesh", "pp=2", "--pipeline-schedule", "zero-bubble",
                                      "--micro-batch-size", "4")),
    # docs/parallelism.md's 8-process command
    "dp_tp_pp": (TINY_GPT, (), ("--mesh", "2x2x2", "--micro-batch-size", "2", "--rules", "zero1")),
    # Muon: matrices whole on the rank (dp, pp, cp, ep), gathered per matrix (tp, ZeRO, fsdp) or given to
    # one owner rank each (the distributed optimizer)
    "muon_dp": (TINY_GPT, MUON, ("--mesh", "dp=2", "--micro-batch-size", "4")),
    "muon_dp_tp_zero1": (TINY_GPT, MUON, ("--mesh", "dp=2,tp=2", "--zero", "1", "--micro-batch-size", "4")),
    "muon_zero2": (TINY_GPT, MUON, ("--mesh", "dp=2", "--zero", "2", "--micro-batch-size", "4")),
    "muon_distributed_optimizer": (TINY_GPT, MUON, ("--mesh", "dp=2", "--zero", "1", "--use-distributed-optimizer",
                                                    "--micro-batch-size", "4")),
    "muon_zero3": (TINY_GPT, MUON, ("--mesh", "dp=2", "--rules", "zero3", "--micro-batch-size", "4")),
    "muon_fsdp": (TINY_GPT, MUON, ("--mesh", "fsdp=2", "--rules", "fsdp", "--micro-batch-size", "4")),
    "muon_tp_sp": (TINY_GPT, MUON, ("--mesh", "tp=2", "--sequence-parallel")),
    "muon_pp": (TINY_GPT, MUON, ("--mesh", "pp=2", "--pipeline-schedule", "1f1b", "--micro-batch-size", "4")),
    "muon_cp": (TINY_GPT, MUON, ("--mesh", "cp=2", "--cp-attention", "ring")),
    "muon_ep": (TINY_MOE, MUON, ("--mesh", "dp=2,ep=2")),
}
# what CI runs: the ones most likely to break on the way from the library to the command line
RISKIEST = ("zero3", "tp_sp", "pp_1f1b", "cp_ring", "ep", "muon_tp_sp")
STEPS, FIRST = 4, 2
# a schedule of 4 steps whichever --steps a run stops at, so that the resumed run continues it
SCHEDULE = ("--lr-decay-iters", str(STEPS), "--log-interval", "1", "--eval-interval", str(FIRST), "--no-progress")


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"  # text, so that the checkpoint has a tokenizer
    path.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return path


_ONE_DEVICE: dict[tuple, dict[int, dict]] = {}


def _one_device(config: str, model: tuple[str, ...], corpus: Path, tmp: Path) -> dict[int, dict]:
    """The one-device run of ``config`` with ``model``'s changes, in this process, once per
    model for the module; eager, since run_rtol bounds kernels' and fusion's summation order
    as it bounds the mesh's (and a compile would add a minute per model)."""
    key = (config, model)
    if key not in _ONE_DEVICE:
        log = tmp / "one_device.jsonl"
        assert main(["--config", config, *model, "--data-path", str(corpus), "--steps", str(STEPS), *SCHEDULE,
                     "--no-compile", "--log-jsonl", str(log)]) == 0
        _ONE_DEVICE[key] = _records(log)
    return _ONE_DEVICE[key]


def _matrix() -> list:
    return [pytest.param(name, marks=[pytest.mark.slow] + ([] if name in RISKIEST else [pytest.mark.e2e]))
            for name in CASES]


@pytest.mark.parametrize("name", _matrix())
def test_the_strategy_trains_evaluates_saves_resumes_and_generates_as_one_device(name, corpus, tmp_path):
    config, model, mesh = CASES[name]
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = ["--config", config, *model, *mesh, "--data-path", str(corpus), *SCHEDULE, "--save", str(ckpt),
            "--log-jsonl", str(log)]
    first = run_py(*args, "--steps", str(FIRST))
    assert f"step {FIRST}: validation loss" in first.stdout
    resumed = run_py(*args, "--steps", str(STEPS), "--load", str(ckpt))
    assert f"resumed from {ckpt}" in resumed.stdout and f"step {STEPS}: validation loss" in resumed.stdout
    records = _records(log)
    assert sorted(records) == list(range(1, STEPS + 1))  # the resumed run went on from step 2
    reference = _one_device(config, model, corpus, tmp_path)
    rtol = run_rtol(config_from_args(parse_args(["--config", config, *model])), STEPS)
    for key in ("loss", "grad_norm"):
        assert [records[s][key] for s in records] == pytest.approx([reference[s][key] for s in records], rel=rtol), key
    for s in (FIRST, STEPS):
        assert records[s]["valid_loss"] == pytest.approx(reference[s]["valid_loss"], rel=rtol)
    generated = run_py("generate", "--load", str(ckpt), *mesh[:2], *_generation_flags(mesh), "--prompt",
                        "the quick", "--max-new-tokens", "8", "--temperature", "0")
    assert "the quick" in generated.stdout and "Traceback" not in generated.stderr


def _generation_flags(mesh: tuple[str, ...]) -> list[str]:
    """The mesh flags generation takes (the layout's, not the training schedule's or ZeRO's)."""
    kept = []
    for flag in ("--rules", "--virtual-stages"):
        if flag in mesh:
            kept += [flag, mesh[mesh.index(flag) + 1]]
    return kept


@pytest.mark.slow
@pytest.mark.e2e
def test_muon_momentum_reshards_from_tp_zero1_to_one_device(corpus, tmp_path):
    """Saved on dp=2 x tp=2 with ZeRO-1 (the momentum sliced both ways), resumed on one device:
    the resumed steps equal the uninterrupted one-device run's, which they would not if the
    momentum (0.95 of each update's direction) had been lost or misplaced."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = ["--config", TINY_GPT, *MUON, "--data-path", str(corpus), *SCHEDULE, "--save", str(ckpt),
            "--log-jsonl", str(log), "--micro-batch-size", "4"]
    run_py(*args, "--mesh", "dp=2,tp=2", "--zero", "1", "--steps", str(FIRST))
    resumed = run_py(*args, "--steps", str(STEPS), "--load", str(ckpt))
    assert f"resumed from {ckpt}" in resumed.stdout
    records, reference = _records(log), _one_device(TINY_GPT, MUON, corpus, tmp_path)
    rtol = run_rtol(config_from_args(parse_args(["--config", TINY_GPT])), STEPS)
    for key in ("loss", "grad_norm"):
        assert [records[s][key] for s in range(1, STEPS + 1)] == \
            pytest.approx([reference[s][key] for s in range(1, STEPS + 1)], rel=rtol), key
