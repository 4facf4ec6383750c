"""Where step metrics go: a JSONL file (one object per step), TensorBoard event files, and
optional experiment trackers (``fxmega.training.tracking``: W&B, MLflow).

Only one rank writes (the caller decides which), so a sharded run's log has the same fields
and lines as a single-device run's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fxmega.core.errors import ConfigError


class RunLog:
    def __init__(self, jsonl_path: str = "", tensorboard_dir: str = "", sinks: list | None = None) -> None:
        self._jsonl = None
        self._tb = None
        self._sinks = sinks or []  # experiment trackers (fxmega.training.tracking)
        if jsonl_path:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl_path, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(
                    f"train.tensorboard_dir={tensorboard_dir!r} is set but TensorBoard is not installed ({e}): "
                    f"pip install 'fxmega[tensorboard]', or leave train.tensorboard_dir empty"
                ) from None
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; ``record['step']`` keys the TensorBoard scalars."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        for sink in self._sinks:
            sink.write(record)
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value
