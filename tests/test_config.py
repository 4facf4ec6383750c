"""Config files, overrides and validation errors that name the key and the fix."""

import pytest

from fxmega.cli import config_from_args, main, parse_args
from fxmega.config import RunConfig, load, override
from fxmega.core.errors import ConfigError
from fxmega.models import gpt
from tests.conftest import ROOT


def test_override_parses_types(tiny_gpt):
    cfg = override(tiny_gpt, ["optim.lr=3e-4", "train.steps=7", "train.compile=false", "data.source=mock"])
    assert cfg.optim.lr == 3e-4 and cfg.train.steps == 7 and cfg.train.compile is False
    assert tiny_gpt.optim.lr != 3e-4  # configs are frozen; override returns a new one


@pytest.mark.parametrize("assignment,message", [
    ("train.lrr=3", "unknown config key 'train.lrr'; did you mean optim.lr"),
    ("bogus=1", "unknown config key 'bogus'"),
    ("optim.lr=fast", "optim.lr='fast': expected a number"),
    ("train.steps=1.5", "train.steps='1.5': expected a whole number"),
    ("train.compile=maybe", "expected true or false"),
    ("model=3", "config key 'model' is a section"),
    ("optim.lr", "has no '='"),
])
def test_override_errors(tiny_gpt, assignment, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        override(tiny_gpt, [assignment])


@pytest.mark.parametrize("assignment,message", [
    ("model.n_heads=5", "model.n_heads=5 does not divide model.d_model=64"),
    ("train.seq_len=100", "train.seq_len=100 is longer than model.max_seq_len=64"),
    ("train.global_batch_size=12", "train.global_batch_size=12 is not a multiple of train.micro_batch_size=8"),
    ("train.steps=0", "train.steps=0 must be positive"),
    ("optim.schedule=exp", "optim.schedule='exp': use one of"),
    ("optim.min_lr=1.0", "optim.min_lr=1.0 is above optim.lr"),
    ("optim.beta2=1.0", "must be in"),
    ("data.valid_fraction=0", "data.valid_fraction=0.0 must be between 0 and 1"),
])
def test_impossible_values_are_rejected(tiny_gpt, assignment, message):
    with pytest.raises(ConfigError, match=message):
        override(tiny_gpt, [assignment]).validate()


def test_llama_specific_validation(tiny_llama):
    with pytest.raises(ConfigError, match="n_kv_heads=3 does not divide model.n_heads=4"):
        override(tiny_llama, ["model.n_kv_heads=3"]).validate()


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.py")
    bad = tmp_path / "bad.py"
    bad.write_text("config = 3\n")
    with pytest.raises(ConfigError, match="must set `config = RunConfig"):
        load(bad)


def test_cli_flags_map_to_keys():
    args = parse_args(["--config", str(ROOT / "configs/tiny_gpt.py"), "--steps", "3", "--lr", "0.01",
                                      "--micro-batch-size", "2", "--global-batch-size", "4", "--no-compile",
                                      "--mock-data", "--set", "train.seed=9"])
    cfg = config_from_args(args)
    assert (cfg.train.steps, cfg.optim.lr, cfg.train.micro_batch_size, cfg.train.global_batch_size) == (3, 0.01, 2, 4)
    assert cfg.train.compile is False and cfg.data.source == "mock" and cfg.train.seed == 9
    assert isinstance(cfg, RunConfig) and isinstance(cfg.model, gpt.Config)


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["--config", str(ROOT / "configs/tiny_gpt.py"), "--set", "model.n_heads=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.n_heads=5") and "Traceback" not in err


def test_summary_command(capsys):
    assert main(["summary", "--config", str(ROOT / "configs/gpt2_124m.py")]) == 0
    assert "parameters: 124,439,808" in capsys.readouterr().out
