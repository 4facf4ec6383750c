"""Experiment trackers beside the JSONL log and TensorBoard: Weights & Biases and MLflow,
each an optional extra (``pip install -e '.[wandb]'`` / ``'.[mlflow]'``), imported only
when its config key is set. Both receive the same numeric fields as the JSONL records.

W&B runs offline unless ``WANDB_MODE`` says otherwise (files under the run directory, to
``wandb sync`` later): a training job must not depend on a web service being up.
"""

from __future__ import annotations

import math
import os
from typing import Any

from fxmega.config import RunConfig
from fxmega.core.errors import ConfigError


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class WandbSink:
    def __init__(self, project: str, name: str, config: dict, directory: str) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"train.wandb_project={project!r} needs wandb: pip install -e '.[wandb]'") from None
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(project=project, name=name, config=config, dir=directory,
                               mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(_numeric(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, uri: str, experiment: str, name: str, config: dict) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError(f"train.mlflow_uri={uri!r} needs mlflow: pip install -e '.[mlflow]'") from None
        self._mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self._run = mlflow.start_run(run_name=name)
        params = {k: str(v)[:500] for k, v in _flat(config).items()}  # MLflow caps a param's length
        for i in range(0, len(params), 100):
            mlflow.log_params(dict(list(params.items())[i:i + 100]))

    def write(self, record: dict[str, Any]) -> None:
        self._mlflow.log_metrics(_numeric(record), step=int(record["step"]))

    def close(self) -> None:
        self._mlflow.end_run()


def sinks(cfg: RunConfig, config: dict) -> list:
    t, out = cfg.train, []
    if t.wandb_project:
        out.append(WandbSink(t.wandb_project, cfg.name, config, t.tracking_dir))
    if t.mlflow_uri:
        out.append(MlflowSink(t.mlflow_uri, t.mlflow_experiment or cfg.name, cfg.name, config))
    return out
