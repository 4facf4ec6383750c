"""Batches built ahead of the step that needs them: a background thread runs the host side of
the next global batches — read the samples, cut this rank's micro batches (and cp chunks),
count the loss tokens, pin the memory on CUDA — while the device runs the current step.

Every batch is a pure function of its step (``global_batch(step)``: the data sources keep no
cursor), so a prefetcher is deterministic and resumes at the same sample by starting at the
resumed step; it only changes when the host work happens. The queue is bounded (``depth``
batches wait at most), so memory stays a few batches whatever the run's length.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class Prefetcher(Generic[Item]):
    """``build(step)`` for ``step`` in ``[start, stop)``, in order, ``depth`` ahead of
    ``get``, on one daemon thread. ``get(step)`` must ask in the same order; an error in
    ``build`` is raised by the ``get`` of its step."""

    def __init__(self, build: Callable[[int], Item], start: int, stop: int, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth}: at least 1 batch must be built ahead (0 turns prefetch off)")
        self.next_step = start
        self._queue: queue.Queue[tuple[int, Item | None, BaseException | None]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(build, start, stop), daemon=True,
                                        name="fxmega-prefetch")
        self._thread.start()

    def _produce(self, build: Callable[[int], Item], start: int, stop: int) -> None:
        for step in range(start, stop):
            try:
                entry = (step, build(step), None)
            except BaseException as e:  # handed to the consumer, raised where the step needs it
                entry = (step, None, e)
            while not self._closed.is_set():
                try:
                    self._queue.put(entry, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._closed.is_set() or entry[2] is not None:
                return

    def get(self, step: int) -> Item:
        if step != self.next_step:
            raise RuntimeError(f"prefetcher asked for step {step} but built step {self.next_step} next: batches are "
                               f"taken in order; make a new Prefetcher to start elsewhere (a resume)")
        built, item, error = self._queue.get()
        assert built == step, (built, step)  # one producer, in order
        self.next_step += 1
        if error is not None:
            self.close()
            raise error
        return item

    def close(self) -> None:
        """Stop the producer (it finishes the batch in hand and exits)."""
        self._closed.set()
        self._thread.join(timeout=10)
