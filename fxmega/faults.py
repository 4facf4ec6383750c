"""Fault injection for the fault-tolerance tests: seams that make a chosen rank fail at a
chosen step, so that restart and resume are tested against real process deaths.

``FXMEGA_TEST_KILL_AT_STEP=RANK:STEP`` SIGKILLs global rank RANK right after it finishes
step STEP, on the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0), so the
restarted group runs through.
"""

from __future__ import annotations

import os
import signal
import sys


def maybe_kill(rank: int, step: int) -> None:
    spec = os.environ.get("FXMEGA_TEST_KILL_AT_STEP", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at_rank, _, at_step = spec.partition(":")
    if int(at_rank) == rank and int(at_step) == step:
        print(f"fault injection: killing rank {rank} after step {step}", flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
