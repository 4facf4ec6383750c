"""Stopping a run on a signal without losing its work.

SIGINT (Ctrl-C) and SIGTERM (what Slurm and Kubernetes send before they kill a preempted
job; torchrun forwards it to its ranks) do not interrupt the step: the handler only notes
the signal, the loop finishes the step, saves a checkpoint and ends with one line that says
how to resume (``Interrupted``, exit status 128 + the signal). A second signal aborts at
once (``Aborted``): a checkpoint being written then stays a ``.tmp_step_N`` directory, and
``latest`` still names the previous complete one.

On a mesh every rank must stop after the same step, or one rank saves while another waits
in the next step's collectives. The ranks vote after every step: one all-reduce (MAX) of the
signal number on the CPU over the whole world — the default group under gloo, a gloo group
beside NCCL's on GPUs, so that the vote never waits for the device.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist

from fxmega.core.errors import FxmegaError
from fxmega.core.log import get_logger

log = get_logger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(FxmegaError):
    """A signal stopped the run after a step was saved; the message says how to resume."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class Aborted(KeyboardInterrupt):
    """A second signal: the run ends at once, whatever it was doing."""


class StopOnSignal:
    """After ``listen``, SIGINT and SIGTERM are noted (``requested``) instead of raising; a
    second one raises ``Aborted``. ``agreed`` is the signal the ranks agree to stop on."""

    def __init__(self, distributed: bool, give_up_after_s: float = 600.0) -> None:
        self.signum = 0
        self.give_up_after_s = give_up_after_s
        self._watchdog: threading.Timer | None = None
        self._previous: dict[int, object] = {}
        self._group = None
        if distributed and dist.get_backend() != "gloo":  # every rank creates it, in the same order
            self._group = dist.new_group(backend="gloo")
        self._distributed = distributed
        self._vote = torch.zeros(1, dtype=torch.int32)

    def listen(self) -> None:
        """Note the signals from now on (only the main thread can: elsewhere, nothing changes)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            raise Aborted(f"aborted by a second signal ({signal.Signals(signum).name}): a checkpoint being written "
                          f"was left unfinished (.tmp_step_*); 'latest' names the last complete one")
        self.signum = signum
        if self._distributed:
            # the stop needs every rank's vote; a rank that cannot reach it (a peer died, and
            # the launcher is stopping the rest) leaves instead of waiting for a SIGKILL
            self._watchdog = threading.Timer(self.give_up_after_s, self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _give_up(self) -> None:
        name = signal.Signals(self.signum).name
        log.warning(f"{name}: the ranks did not agree to stop within {self.give_up_after_s:.0f} s "
                    f"(parallel.timeout_s): another rank is gone, so this one ends without saving")
        sys.stdout.flush()
        os._exit(128 + self.signum)

    def agreed(self) -> int:
        """The signal any rank has seen (0 for none): every rank calls this once per step,
        and all of them get the same answer."""
        if not self._distributed:
            return self.signum
        self._vote.fill_(self.signum)
        dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self._group)
        agreed = int(self._vote.item())
        if agreed and self._watchdog is not None:  # agreed: the save may take as long as it takes
            self._watchdog.cancel()
        return agreed


def resume_command(save_root: str, saved_by_default: bool, argv: list[str] | None = None) -> str:
    """The command line that continues this run from ``save_root``: the one that started it,
    with ``--load save_root`` (and ``--save`` where the run had no save directory)."""
    argv = list(sys.argv if argv is None else argv)
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--load":
            skip = True
        elif not arg.startswith("--load="):
            kept.append(arg)
    extra = ["--load", save_root] + (["--save", save_root] if saved_by_default else [])
    script = os.path.relpath(argv[0]) if os.path.abspath(argv[0]).startswith(os.getcwd() + os.sep) else argv[0]
    python = sys.executable
    python = os.path.relpath(python) if python.startswith(os.getcwd() + os.sep) else "python"
    return shlex.join([python, script, *kept, *extra])
