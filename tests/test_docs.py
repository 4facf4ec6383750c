"""The documentation's commands work: every ``python run.py`` line in README.md and docs/
parses with today's parsers (a renamed or moved flag fails here), and its config, where the
page names one that exists, validates with the flags applied; a line shown failing fails
with the message shown; every planning command (any mesh, one process) runs. The two
how-tos are walked through: their files are written into an empty directory and their
commands run."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from fxmega.cli import config_from_args, main, parse_args
from fxmega.cli.commands import FROM_CHECKPOINT
from fxmega.models import registry
from fxmega.sharding.mesh import MeshSpec
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)^```", re.S | re.M)


def commands(page: Path) -> list[tuple[list[str], str]]:
    """(argv, the error the page shows it printing, or "") for every ``python run.py`` (or
    ``torchrun ... run.py``) line in the page's code blocks, continuations joined, comments
    dropped."""
    out = []
    for block in FENCE.findall(page.read_text()):
        lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        for i, line in enumerate(lines):
            line = line.removeprefix("$ ")
            if not (line.startswith("python run.py") or line.startswith("torchrun ")) or "run.py" not in line:
                continue
            words = shlex.split(line, comments=True)
            shown = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("error: ") else ""
            out.append((words[words.index("run.py") + 1:], shown.removeprefix("error: ").removesuffix("...")))
    return out


def files(page: Path) -> dict[str, str]:
    return dict(FILE_BLOCK.findall(page.read_text()))


ALL = [(page.relative_to(ROOT).as_posix(), argv, error) for page in PAGES for argv, error in commands(page)]


def test_the_pages_have_commands():
    pages = {name for name, _, _ in ALL}
    assert {"README.md", "docs/howto-model-family.md", "docs/howto-sharding-rules.md"} <= pages, pages
    assert len(ALL) > 30


@pytest.mark.parametrize("page,argv,error", ALL, ids=[f"{p}:{' '.join(a)[:60]}" for p, a, _ in ALL])
def test_documented_command_parses(page, argv, error, capsys):
    args = parse_args(argv)
    config = args.config and (ROOT / args.config)
    if error:  # the page shows the command failing: it fails, before anything runs, as shown
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith(f"error: {error.strip()}")
    elif config and config.exists():
        config_from_args(args).validate(None)
    else:  # a file the page itself writes (the how-tos), a placeholder, or a checkpoint's config
        assert args.config in {*files(ROOT / page), None} or args.config.isupper() or \
            args.command in FROM_CHECKPOINT, args.config


HOWTOS = ("docs/howto-model-family.md", "docs/howto-sharding-rules.md")  # walked through below
# the planning commands run in seconds on any mesh size: every page's are run, once each
PLANS = sorted({(page, tuple(argv)) for page, argv, error in ALL
                if not error and page not in HOWTOS and parse_args(argv).command in ("plan", "summary")})


@pytest.mark.slow
@pytest.mark.parametrize("page,argv", PLANS, ids=[f"{p}:{' '.join(a)[:60]}" for p, a in PLANS])
def test_documented_planning_commands_run(page, argv, tmp_path, monkeypatch, capsys):
    argv = [str(ROOT / w) if w.startswith("configs/") else w for w in argv]
    monkeypatch.chdir(tmp_path)  # what they write (--plan-html, --dump-kernels) goes here
    assert main(argv) == 0, argv
    assert capsys.readouterr().out.strip()


@pytest.fixture
def howto_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:  # the how-to's modules, imported from tmp_path
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if str(tmp_path) not in p]


def walk(page: Path, directory: Path) -> list[list[str]]:
    """Write the page's files into ``directory`` and run each of its commands that runs in
    one process; the others (a mesh of several ranks) only parse."""
    for name, text in files(page).items():
        (directory / name).write_text(text)
    ran = []
    for argv, _ in commands(page):
        args = parse_args(argv)
        if args.command == "plan" or MeshSpec.parse(config_from_args(args).parallel.mesh).world_size == 1:
            assert main(argv) == 0, argv
            ran.append(argv)
    return ran


def test_howto_model_family(howto_dir, capsys):
    try:
        ran = walk(ROOT / "docs" / "howto-model-family.md", howto_dir)
        out = capsys.readouterr().out
    finally:
        registry.unregister("doc-mixer")
    assert len(ran) == 3
    assert "parameters: 11,072" in out  # the count the page quotes
    assert "model: doc-mixer, 11,072 parameters" in out  # trained through the registry
    assert "blocks.0.w_in                [32, 64]      (embed, mlp)    S(1)" in out  # split by its names alone
    losses = [json.loads(line)["loss"] for line in (howto_dir / "mixer.jsonl").read_text().splitlines()]
    assert len(losses) == 40 and losses[0] > 3.9  # about ln 61: the mock tokens are uniform over 61 ids
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses  # it learns the mock stream's repeating pattern


def test_howto_sharding_rules(howto_dir, capsys):
    ran = walk(ROOT / "docs" / "howto-sharding-rules.md", howto_dir)
    out = capsys.readouterr().out
    assert [a[0] for a in ran] == ["plan"] * 3
    page = (ROOT / "docs" / "howto-sharding-rules.md").read_text()
    for line in ("blocks.0.mlp.w_in         [64, 256]       (embed, mlp)                   S(0) S(1)",
                 "blocks.0.mlp.w_out        [256, 64]       (mlp, embed)                   S(1) S(0)"):
        assert line in page and line in out  # the page quotes what the command prints
    assert "rules: embed -> fsdp, mlp -> tp, heads -> tp, vocab -> tp" in out
    assert "checked on a fake 4-rank process group" in out and "fits:" in out
