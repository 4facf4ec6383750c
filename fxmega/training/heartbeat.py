"""Heartbeats in the process group's key-value store, so that a hang explains itself and
stragglers are named.

Every rank writes the step it begins and the step it finishes, with the time, to the
launcher's store. The store is not the collectives' transport: it still answers when a
collective has timed out and gloo has closed its connections (measured: after a gloo
timeout even ``monitored_barrier`` on the same group fails). So when a step's collective
times out, the rank reads everyone's heartbeat and names who is behind, on which mesh axis
they differ from it, and the operation the backend reported.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import torch.distributed as dist

from fxmega.core.errors import FxmegaError, LauncherLostError

_KEY = "fxmega/heartbeat/{}"
# what gloo and NCCL say when a collective gives up waiting for a peer
_HANG_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "pair closure", "watchdog")


class HangError(FxmegaError):
    """A collective timed out because a rank stalled or died."""


@dataclass
class Beat:
    rank: int
    started: int  # the last step this rank began
    started_at: float
    done: int  # the last step it finished
    done_at: float

    @property
    def progress(self) -> float:
        return max(self.started, self.done + 0.5)

    @property
    def phase(self) -> str:
        return "finished it" if self.done >= self.started else "inside it"

    @property
    def step(self) -> int:
        return max(self.started, self.done)

    @property
    def at(self) -> float:
        return max(self.started_at, self.done_at)


class Heartbeat:
    def __init__(self, rank: int, world: int, coords_of, axes: tuple[str, ...]) -> None:
        self.rank, self.world, self.coords_of, self.axes = rank, world, coords_of, axes
        self.store = dist.distributed_c10d._get_default_store()
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def start(self, step: int) -> None:
        # kept per step in a ring of 4: rank 0 reads a step's arrivals after other ranks may
        # already have begun the next one (two store writes per step and rank in all)
        self._set(self._key(f"start{step % 4}", self.rank), f"{step} {time.time():.6f}", step)

    def done(self, step: int) -> None:
        self._set(self._key("done", self.rank), f"{step} {time.time():.6f}", step)

    def _set(self, key: str, value: str, step: int) -> None:
        try:
            self.store.set(key, value)
        except dist.DistError as e:
            raise self._lost(step, e) from e

    def _lost(self, step: int, error: BaseException) -> LauncherLostError:
        return LauncherLostError(f"rank {self.rank}: the launcher's rendezvous store stopped answering at step "
                                 f"{step} ({str(error).splitlines()[0][:120]}); the launcher has ended, so this rank "
                                 f"stops too")

    def _key(self, kind: str, rank: int) -> str:
        return _KEY.format(f"{self.attempt}/{kind}/{rank}")

    def _get(self, kind: str, rank: int) -> tuple[int, float]:
        key = self._key(kind, rank)
        if not self.store.check([key]):
            return 0, 0.0
        step, at = self.store.get(key).decode().split()
        return int(step), float(at)

    def read(self) -> list[Beat]:
        out = []
        for r in range(self.world):
            started, started_at = max(self._get(f"start{i}", r) for i in range(4))
            done, done_at = self._get("done", r)
            if started or done:
                out.append(Beat(r, started, started_at, done, done_at))
        return out

    def stragglers(self, step: int) -> tuple[int, float] | None:
        """The rank that began ``step`` last, and by how many seconds after the first: in
        synchronous training everyone else waits for it (their own step times include that
        wait, so step times alone would blame the waiting ranks)."""
        try:
            starts = [(r, self._get(f"start{step % 4}", r)) for r in range(self.world)]
        except dist.DistError as e:
            raise self._lost(step, e) from e
        arrivals = [(r, at) for r, (s, at) in starts if s == step]
        if len(arrivals) < 2:
            return None
        first = min(at for _, at in arrivals)
        rank, last = max(arrivals, key=lambda x: x[1])
        return rank, last - first

    def explain(self, error: BaseException, step: int) -> BaseException:
        """A HangError naming the stalled ranks, if ``error`` is a collective that gave up
        waiting; otherwise ``error`` itself."""
        text = str(error)
        if not any(w in text.lower() for w in _HANG_WORDS):
            return error
        op = re.search(r"for (\w+) operation", text)
        what = (f"the backend reports a {op.group(1)} operation timing out" if op else
                f"the backend reports: {text.splitlines()[0][:160]}")
        try:
            beats = self.read()
        except dist.DistError as e:
            # the store itself is gone: the launcher that hosts it has died (a peer that saw it
            # first has exited, which is why the collective failed), and nobody is left to
            # print this rank's error but the rank itself (``LauncherLostError``)
            return self._lost(step, e)
        now = time.time()
        mine = next((b for b in beats if b.rank == self.rank), None)
        behind = [b for b in beats if mine is not None and b.progress < mine.progress]
        silent = [r for r in range(self.world) if r not in {b.rank for b in beats}]
        me = self._where(self.rank)
        if behind or silent:
            parts = [f"rank {b.rank} ({self._where(b.rank)}), still at step {b.step} ({b.phase}), last heard "
                     f"{now - b.at:.0f} s ago" for b in behind] + [f"rank {r}, which never reported" for r in silent]
            ranks = [b.rank for b in behind] + silent
            axes = sorted({a for r in ranks for a in self._differ(r)})
            return HangError(f"rank {self.rank} ({me}) timed out in step {step} waiting for {'; '.join(parts)}. "
                             f"They differ from this rank on mesh axis {', '.join(axes) or '(none)'}, so the stuck "
                             f"collective is on that axis' group; {what}. Check those ranks' logs and hosts; "
                             f"parallel.timeout_s sets how long a collective waits")
        return HangError(f"rank {self.rank} ({me}) timed out in step {step}; every rank entered the step, so one is "
                         f"stuck inside it; {what}. Ranks' last heartbeats: " +
                         ", ".join(f"{b.rank}: {now - b.at:.0f} s ago" for b in beats))

    def _where(self, rank: int) -> str:
        coords = self.coords_of(rank)
        return ", ".join(f"{a}={coords[a]}" for a in self.axes) or "single"

    def _differ(self, rank: int) -> list[str]:
        mine, theirs = self.coords_of(self.rank), self.coords_of(rank)
        return [a for a in self.axes if mine[a] != theirs[a]]
