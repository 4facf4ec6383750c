"""Code that runs inside the ranks of tests/test_interrupt.py (see multirank.py)."""

import os
import signal

import torch.distributed as dist

from fxmega.training.interrupt import StopOnSignal


def votes_with_one_rank_signalled(steps: int, signalled_rank: int, at_step: int) -> list[int]:
    """What ``agreed`` answers after each of ``steps`` steps when only ``signalled_rank``
    receives SIGTERM, during step ``at_step``."""
    stop = StopOnSignal(distributed=True)
    stop.listen()
    try:
        answers = []
        for step in range(1, steps + 1):
            if dist.get_rank() == signalled_rank and step == at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(stop.agreed())
        return answers
    finally:
        stop.restore()
