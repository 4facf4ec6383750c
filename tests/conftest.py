"""Test settings: deterministic CPU runs, one inductor cache per test session so that
compiled graphs are reused across tests but never shared with other processes' caches, and
property tests that draw the same examples on every run (``make test``) unless asked to
explore (``make fuzz``: the ``fuzz`` hypothesis profile, fresh examples, many more)."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# one cache per CPU kernel set: inductor's cache does not tell them apart (fxmega.core.device)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(ROOT / ".cache" / "inductor-tests" / (os.environ.get("ATEN_CPU_CAPABILITY") or "native")))
# Inductor compiles C++ kernels in a pool of worker processes, one per core by default; on
# 2 cores, with gloo ranks compiling side by side, the pool costs more than it gains (the
# suite ran 12% faster per compile in one thread). Children (ranks, run.py) inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# FXMEGA_SUITE_PROFILE=FILE: every process the suite starts appends where its time went
# (tests/suite_profile; docs/testing.md says how to read it)
PROFILE = os.environ.get("FXMEGA_SUITE_PROFILE")
if PROFILE:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests" / "suite_profile"),
                                                           os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402

# ci: the same examples for the same commit, so a random draw never turns CI red on a change
# that did not cause it; fuzz: new examples each run, kept in a local database so a failure
# found once is replayed until it is fixed (and then written into the test as an @example)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, print_blob=True)
FUZZING = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "fuzz"
settings.load_profile("fuzz" if FUZZING else "ci")

torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--e2e", action="store_true",
                     help="also run the tests marked e2e: the whole user-path matrix and the second cases of "
                          "heavy checks (make e2e)")


def pytest_configure(config: pytest.Config) -> None:
    """Tells the test modules, their ranks and subprocesses which tier runs (tests/tiers.py)."""
    if config.getoption("--e2e"):
        os.environ["FXMEGA_E2E"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --e2e, the e2e tests are deselected: make test runs the matrix' riskiest cases and
    one case of each heavy check, to stay within CI's time."""
    if config.getoption("--e2e"):
        return
    skipped = [item for item in items if "e2e" in item.keywords]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if "e2e" not in item.keywords]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts with no compiled graphs, so graph counts are its own."""
    import torch._dynamo

    torch._dynamo.reset()
    if not PROFILE:
        yield
        return
    import json
    import time

    from torch._dynamo.utils import calculate_time_spent, counters

    def snapshot() -> tuple[dict, dict]:
        return dict(calculate_time_spent()), {f"{g}.{k}": v for g in ("inductor", "aot_autograd", "stats")
                                              for k, v in counters[g].items()}

    (spent, counted), start = snapshot(), time.monotonic()
    yield
    (spent_after, counted_after) = snapshot()
    with open(PROFILE, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "in_pytest": True,
                              "alive_s": round(time.monotonic() - start, 3),
                              "compile": {k: round(v - spent.get(k, 0.0), 3) for k, v in spent_after.items()},
                              "counters": {k: v - counted.get(k, 0) for k, v in counted_after.items()}}) + "\n")


@pytest.fixture
def tiny_gpt():
    from fxmega.config import load

    return load(ROOT / "configs" / "tiny_gpt.py")


@pytest.fixture
def tiny_llama():
    from fxmega.config import load

    return load(ROOT / "configs" / "tiny_llama.py")
