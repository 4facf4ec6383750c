"""The command line: each command's --help lists its own flags only, a flag given to the wrong
command is refused naming the commands it belongs to, every flag reaches a real config key,
and messages go through rank-aware logging."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from fxmega.cli import main, parse_args
from fxmega.cli.parser import COMMANDS, GROUPS, command_parser, config_from_args, owners
from fxmega.config import load
from fxmega.core import log
from tests.conftest import ROOT

TINY = str(ROOT / "configs" / "tiny_gpt.py")


# what a new user found in generate --help and serve --help: flags that only training reads
TRAINING_ONLY = ["--zero", "--use-distributed-optimizer", "--overlap-comm", "--ddp-bucket-size",
                 "--pipeline-schedule", "--data-path", "--mock-data", "--loss-scale", "--grad-reduce"]


def _help(command: str) -> str:
    return command_parser(command).format_help()


@pytest.mark.parametrize("command,has,lacks", [
    ("train", ["--train-iters", "--lr", "--mesh", "--save", "--log-level"],
     ["--prompt", "--port", "--from-hf", "--explain"]),
    ("generate", ["--prompt", "--load", "--mesh", "--rules", "--temperature", "--tokenizer"],
     ["--lr", "--save", "--port", "--train-iters", *TRAINING_ONLY]),
    ("serve", ["--port", "--host", "--load", "--mesh", "--tokenizer"], ["--prompt", "--lr", "--eval-iters",
                                                                         "--max-new-tokens", "--temperature",
                                                                         *TRAINING_ONLY]),  # per request
    ("eval", ["--load", "--eval-iters", "--data-path"], ["--lr", "--prompt", "--save"]),
    ("convert", ["--from-hf", "--to-orbax", "--save", "--load"], ["--lr", "--mesh", "--prompt"]),
    ("plan", ["--explain", "--memory-per-device", "--devices", "--mesh"], ["--lr", "--save", "--prompt"]),
    ("finetune", ["--valid-path", "--num-classes", "--lr"], ["--prompt", "--port"]),
    ("summary", ["--config", "--seq-length"], ["--mesh", "--lr"]),
])
def test_help_lists_only_the_commands_flags(command, has, lacks):
    text = _help(command)
    for flag in has:
        assert f"{flag} " in text or f"{flag}\n" in text, f"{command} --help lacks {flag}"
    for flag in lacks:
        assert f"{flag} " not in text and f"{flag}\n" not in text, f"{command} --help lists {flag}"


def test_help_groups_flags_as_megatron_does():
    text = _help("train")
    for title in ("training:", "learning rate:", "checkpointing:", "mixed precision:", "distributed:",
                  "validation:", "data:", "logging:"):
        assert f"\n{title}\n" in text


@pytest.mark.parametrize("argv,message", [
    (["generate", "--load", "x", "--lr", "1"], "--lr is not a flag of `run.py generate`: it belongs to train, "
                                               "finetune"),
    (["--config", TINY, "--prompt", "hi"], "--prompt is not a flag of `run.py train`: it belongs to generate"),
    (["--config", TINY, "--port=9"], "--port is not a flag of `run.py train`: it belongs to serve"),
    (["--config", TINY, "--plan"], "--plan is a command now: run.py plan"),
    (["--config", TINY, "--summary"], "--summary is a command now: run.py summary"),
    (["--config", TINY, "--mesh", "auto", "--devices", "8"], "--devices is not a flag of `run.py train`"),
    (["--config", TINY, "--mesh", "auto"], "--mesh auto chooses a layout and runs nothing: run.py plan"),
    (["trian", "--config", TINY], "unknown command 'trian'"),
    (["plan", "--mesh", "2x2"], "run.py plan needs --config"),
])
def test_wrong_command_flags_are_refused_by_name(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_flags_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", TINY, "--no-such-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_every_flag_belongs_to_a_command_and_every_key_exists():
    cfg = load(TINY)
    for title, flags in GROUPS.items():
        for flag in flags:
            assert owners(flag.name), f"{flag.name} ({title}) belongs to no command"
            key = flag.key or flag.switch.split("=")[0]
            if key:
                section, field = key.split(".")
                assert field in {f.name for f in dataclasses.fields(getattr(cfg, section))}, key


def test_each_command_maps_its_flags_to_the_config():
    cfg = config_from_args(parse_args(["generate", "--config", TINY, "--seed", "7", "--mesh", "tp=2", "--bf16"]))
    assert (cfg.train.seed, cfg.parallel.mesh, cfg.compute.precision) == (7, "tp=2", "bf16")
    cfg = config_from_args(parse_args(["--config", TINY, "--mock-data", "--data-path", "x", "--precision", "fp16",
                                       "--bf16", "--set", "train.seed=3"]))
    # switches apply after values and --data-path, --set last
    assert (cfg.data.source, cfg.compute.precision, cfg.train.seed) == ("mock", "bf16", 3)
    assert set(COMMANDS) == {"train", "finetune", "eval", "generate", "serve", "convert", "plan", "summary"}


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f"\n  {c} " in out for c in COMMANDS)


@pytest.fixture
def restore_level():
    yield
    log.set_level("info")


def test_rank_zero_speaks_every_rank_warns(monkeypatch, capsys, restore_level):
    logger = log.get_logger("fxmega.tests")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    logger.info("progress from rank 1")
    logger.warning("trouble on rank 1")
    logger.error("failure on rank 1")
    monkeypatch.setenv("RANK", "0")
    logger.info("progress from rank 0")
    out, err = capsys.readouterr()
    assert "progress from rank 1" not in out
    assert "[rank 1] warning: trouble on rank 1\n" in out and "[rank 1] error: failure on rank 1\n" in err
    assert "[rank 0] progress from rank 0\n" in out
    log.set_level("debug")  # at debug every rank says everything
    monkeypatch.setenv("RANK", "1")
    logger.debug("detail")
    assert "[rank 1] debug: detail" in capsys.readouterr().out
    log.set_level("warning")
    logger.info("hidden")
    assert capsys.readouterr().out == ""


def test_log_level_flag_sets_the_level(capsys, restore_level):
    assert main(["summary", "--config", TINY, "--log-level", "error"]) == 0
    assert logging.getLogger("fxmega").level == logging.ERROR
    assert "parameters:" in capsys.readouterr().out  # the command's output is not a message
