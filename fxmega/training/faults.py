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

from fxmega.core.log import get_logger

log = get_logger(__name__)


def maybe_kill(rank: int, step: int) -> None:
    spec = os.environ.get("FXMEGA_TEST_KILL_AT_STEP", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at_rank, _, at_step = spec.partition(":")
    if int(at_rank) == rank and int(at_step) == step:
        log.warning(f"fault injection: killing rank {rank} after step {step}")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_poison(step: int, n_tokens):
    """``FXMEGA_TEST_NAN_AT_STEP=STEP``: step STEP divides its loss by a NaN token count, so
    its loss and every gradient are NaN (what a corrupted batch or an overflow produces)."""
    at = os.environ.get("FXMEGA_TEST_NAN_AT_STEP", "")
    if at and int(at) == step:
        return n_tokens * float("nan")
    return n_tokens


class SpikeDetector:
    """Flags a loss more than ``z`` standard deviations above the mean of the last
    ``window`` losses (after at least ``min_count`` of them): a warning, not an action."""

    def __init__(self, z: float, window: int = 50, min_count: int = 10) -> None:
        self.z, self.window, self.min_count = z, window, min_count
        self.history: list[float] = []

    def score(self, loss: float) -> float | None:
        """The loss' z-score when it is a spike, else None; the loss joins the window."""
        out = None
        if self.z > 0 and len(self.history) >= self.min_count:
            mean = sum(self.history) / len(self.history)
            std = (sum((x - mean) ** 2 for x in self.history) / len(self.history)) ** 0.5
            if std > 0 and (loss - mean) / std > self.z:
                out = (loss - mean) / std
        self.history = (self.history + [loss])[-self.window:]
        return out


def maybe_stall(rank: int, step: int) -> None:
    """``FXMEGA_TEST_STALL_AT_STEP=RANK:STEP:SECONDS``: rank RANK sleeps before step STEP,
    as a rank on a sick host would, so the others' collectives time out."""
    spec = os.environ.get("FXMEGA_TEST_STALL_AT_STEP", "")
    if not spec:
        return
    at_rank, at_step, seconds = spec.split(":")
    if int(at_rank) == rank and int(at_step) == step:
        import time

        time.sleep(float(seconds))
