"""``run.py`` as a user runs it: a subprocess, from a working directory, with the default
compiler. Shared by the tests that type commands (the user-path matrix, the documented
commands, generate and serve)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env() -> dict[str, str]:
    """The caller's environment (its inductor cache among it) with one thread per process:
    two cores hold several ranks only when none spawns a thread per core."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_py(*args: str, cwd: Path = ROOT, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python run.py ARGS`` in ``cwd``; it must exit 0 (the output's tail is the message if not)."""
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env())
    assert proc.returncode == 0, f"run.py {' '.join(args)}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@contextlib.contextmanager
def serving(args: list[str], cwd: Path = ROOT) -> Iterator[str]:
    """``run.py serve ARGS --port 0`` in a subprocess: yields its URL once it listens, and on
    leaving interrupts it as Ctrl-C would (a mesh's launcher then stops its workers)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "serve", *args, "--port", "0"], cwd=cwd,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen, url = [], None
        for line in proc.stdout:  # the server says where it listens once it is up
            seen.append(line)
            if line.removeprefix("[rank 0] ").startswith("serving "):  # a mesh's lines carry the rank
                url = line.split(" on ")[1].split()[0]
                break
        assert url and url.startswith("http://127.0.0.1:"), "".join(seen)[-3000:]
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
