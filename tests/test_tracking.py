"""Experiment trackers, each tested where its extra is installed (CI installs neither):
W&B in offline mode and MLflow with a file store receive the step metrics."""

import pytest

from fxmega.cli import main
from fxmega.core.errors import ConfigError
from tests.conftest import ROOT

ARGS = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mock-data", "--no-progress", "--no-compile",
        "--steps", "3"]


def test_mlflow_receives_every_step(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    # a file store: mlflow-skinny has no database driver, and MLflow 3 asks for this opt-in
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    assert main([*ARGS, "--set", f"train.mlflow_uri={uri}", "--set", "train.mlflow_experiment=fuzz"]) == 0
    client = mlflow.tracking.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("fuzz").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert run.data.params["model.d_model"] == "64"


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main([*ARGS, "--set", "train.wandb_project=fxmega-test", "--set", f"train.tracking_dir={tmp_path}"]) == 0
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))  # the run's records, to `wandb sync` later


def test_missing_tracker_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow":
            raise ImportError("no mlflow here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    from fxmega.training.tracking import MlflowSink

    with pytest.raises(ConfigError, match="needs mlflow: pip install -e '.\\[mlflow\\]'"):
        MlflowSink("file:/tmp/x", "e", "n", {})
