"""Messages, rank-aware: ``log = get_logger(__name__)``, then ``log.info(...)``.

Rank 0 says what it is doing; every rank reports its warnings and errors, and at the debug
level every rank says everything.
Under a launcher (``WORLD_SIZE`` > 1) each line starts with ``[rank R]``. Lines go through
``tqdm.write``, so a progress bar on the terminal is cleared and redrawn around them rather
than torn; info and warnings go to stdout, errors to stderr. ``--log-level`` sets the level.

The stream is looked up when a line is written, not when the handler is made, so output
redirected later (pytest's capsys, a launcher's pipes) receives it.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from fxmega.core.errors import ConfigError

ROOT = "fxmega"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _RankFilter(logging.Filter):
    """Rank 0 passes everything; other ranks warnings and errors, and everything at debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank, _ = _rank_and_world()
        return rank == 0 or record.levelno >= logging.WARNING or logging.getLogger(ROOT).level <= logging.DEBUG


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank, world = _rank_and_world()
        prefix = f"[rank {rank}] " if world > 1 else ""
        if record.levelno >= logging.WARNING or record.levelno < logging.INFO:
            prefix += f"{record.levelname.lower()}: "
        return prefix + super().format(record)


class _BarSafeHandler(logging.Handler):
    """Writes through tqdm (bars stay whole) to the current sys.stdout / sys.stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.ERROR else sys.stdout
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # logging must never take the run down
            self.handleError(record)


def _install() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _BarSafeHandler) for h in root.handlers):
        handler = _BarSafeHandler()
        handler.setFormatter(_Format("%(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # one line per message, whatever the host application configured
    return root


_install()


def get_logger(name: str) -> logging.Logger:
    """The logger of an fxmega module (``__name__``), under the ``fxmega`` root."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def set_level(level: str) -> None:
    """``--log-level``: debug | info | warning | error."""
    if level not in LEVELS:
        raise ConfigError(f"--log-level {level!r}: use one of {', '.join(LEVELS)}")
    _install().setLevel(LEVELS[level])
