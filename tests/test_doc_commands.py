"""Every command line of README.md and docs/*.md, run as a user runs it (issue 46 item 5):
``python run.py ...`` as a subprocess with the default compiler, from a working directory
that holds what the pages assume (their checkpoints, data files and model directories), and
the multi-node ``torchrun`` lines on two local launchers.

A command runs as the page shows it, shrunk only where this machine needs it, and always the
same way (``shrunk`` says how): training stops after 2 steps (4 when it resumes a 2-step
checkpoint), validating once; a cluster's model (gpt2_124m, llama2_7b) gets 4 blocks 64 wide
and batches of one short sequence; a mesh axis over 2 ranks gets 2. Placeholders (``C``,
``~/models/gpt2``, ``path/to/bert-dir``, a 1000-step checkpoint) name what the working
directory holds.

tests/test_docs.py checks the rest of the pages' commands: each parses and validates, each
shown failing fails as shown, each planning command runs, and the how-tos are walked. Here
``make test`` runs the commands no other test runs as typed; ``make e2e`` runs them all.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from fxmega.cli import main, parse_args
from fxmega.data.corpus import ensure_shakespeare
from fxmega.data.preprocess import preprocess
from fxmega.data.vocab_files import ensure_gpt2_ranks
from fxmega.storage.pretrained import ensure_minilm
from tests.commands import env, run_py, serving
from tests.conftest import ROOT
from tests.multirank import free_port
from tests.test_docs import ALL, FENCE, HOWTOS, PAGES

# placeholders of the pages -> what the working directory holds in their place
PLACEHOLDERS = {"C": "configs/tiny_gpt.py", "~/models/gpt2": "hf/gpt2", "ckpt/step_00001000": "ckpt/step_00000002",
                "path/to/bert-dir": str(ROOT / "data" / "models" / "all-MiniLM-L6-v2")}
# a cluster's model, scaled to seconds on 2 cores: same family, layout and strategy
CLUSTER_MODELS = {
    "configs/gpt2_124m.py": ("model.n_layers=4", "model.d_model=64", "model.n_heads=4"),
    # its data is the user's (a sentencepiece corpus); the mock stream stands in
    "configs/llama2_7b.py": ("model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=128", "model.vocab_size=256", "data.source=mock", "data.tokenizer=byte"),
}
CUDA_ONLY = "--kernels triton"  # docs/precision.md: "CUDA: Triton norms and cross-entropy"
SMALL = ("configs/tiny_", "configs/shakespeare_gpt.py")
TRAINED = 2  # the steps of the working directory's checkpoints
# run by another test as typed (test_user_path's matrix): page, mesh flags -> that test
ELSEWHERE = {
    "--mesh dp=2 --rules zero3 --micro-batch-size 4": "test_user_path.py[zero3]",
    "--mesh 2x2x2 --micro-batch-size 2 --rules zero1": "test_user_path.py[dp_tp_pp]",
    "--mesh tp=2 --sequence-parallel": "test_user_path.py[tp_sp]",
}


def shrunk(argv: list[str]) -> list[str]:
    """The documented command as it runs here (see the module's docstring)."""
    argv = [PLACEHOLDERS.get(word, word) for word in argv]
    args = parse_args(argv)
    if "--mesh" in argv:
        i = argv.index("--mesh") + 1
        argv[i] = re.sub(r"\d+", lambda size: str(min(int(size.group()), 2)), argv[i])
    if args.command not in ("train", "finetune"):
        return argv
    extra = ["--steps", str(2 * TRAINED if "--load" in argv else TRAINED), "--eval-interval", str(TRAINED),
             "--eval-iters", "1", "--log-interval", "1", "--no-progress"]
    if not args.config.startswith(SMALL):
        assert args.config in CLUSTER_MODELS, f"{args.config}: say in CLUSTER_MODELS how it shrinks to run here"
        extra += [word for key in CLUSTER_MODELS[args.config] for word in ("--set", key)]
        extra += ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4"]
    return argv + extra


def _run_elsewhere(argv: list[str]) -> str | None:
    return next((test for flags, test in ELSEWHERE.items() if " ".join(argv).endswith(flags)), None)


def torchrun_lines() -> list[tuple[str, list[str]]]:
    """(page, words) of every multi-node ``torchrun ... run.py ...`` line."""
    out = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip().startswith("torchrun "):
                    out.append((page.relative_to(ROOT).as_posix(), shlex.split(line.strip(), comments=True)))
    return out


TORCHRUN = torchrun_lines()
# docs/data.md's preprocessing line: the working directory's data/corpus is made by it
PREPROCESS = next(shlex.split(line.strip()) for block in FENCE.findall((ROOT / "docs" / "data.md").read_text())
                  for line in block.replace("\\\n", " ").splitlines()
                  if line.strip().startswith("python -m fxmega.data.preprocess"))
_MULTI_NODE = {tuple(words[words.index("run.py") + 1:]) for _, words in TORCHRUN}
DOCUMENTED = sorted({(page, tuple(argv)) for page, argv, error in ALL
                     if not error and page not in HOWTOS and parse_args(argv).command not in ("plan", "summary")
                     and tuple(argv) not in _MULTI_NODE})
# what make test runs: the commands a user types first, and those no other test types
IN_CI = {"--config configs/tiny_gpt.py", "generate --load runs/ckpt --mesh pp=2 --prompt ROMEO:",
         "eval --load runs/ckpt --mesh tp=2"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """What the pages assume a user has: the configs, data/ (Shakespeare, the GPT-2 ranks, a
    BERT directory, indexed corpora), the checkpoints of `make run` and of a tiny GPT (ckpt,
    runs/ckpt), a converted BERT, an Orbax export, a Hugging Face GPT-2 directory and the
    fine-tuning files. Built in this process, eager: it is the setting, not the test."""
    ws = tmp_path_factory.mktemp("user")
    shared = ROOT / "data"  # fetched once into the repository's cache (a fresh clone has none), then linked
    ensure_shakespeare(shared, quiet=True)
    ensure_gpt2_ranks(shared)
    ensure_minilm(shared)
    (ws / "configs").symlink_to(ROOT / "configs")
    (ws / "data").mkdir()
    for name in ("shakespeare", "vocab", "models"):
        (ws / "data" / name).symlink_to(shared / name)
    text = shared / "shakespeare" / "shakespeare.txt"
    small = ws / "small.txt"
    small.write_text(text.read_text()[:200_000])
    paragraphs = small.read_text().split("\n\n")
    (ws / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in paragraphs))
    preprocessing = subprocess.run([sys.executable, *PREPROCESS[1:]], cwd=ws, env=env(), capture_output=True, text=True)
    assert preprocessing.returncode == 0 and (ws / "data" / "corpus_text_document.idx").exists(), preprocessing.stderr
    for corpus in ("web", "code"):
        preprocess([small], ws / "data" / corpus, "gpt2", progress=False)
    eager = ["--no-compile", "--no-progress", "--steps", str(TRAINED)]
    with contextlib.chdir(ws):
        assert main(["--config", "configs/shakespeare_gpt.py", *eager, "--eval-interval", "0"]) == 0
        assert main(["--config", "configs/tiny_gpt.py", "--data-path", str(small), *eager, "--save", "ckpt"]) == 0
        shutil.copytree(ws / "ckpt", ws / "runs" / "ckpt")
        assert main(["convert", "--load", "ckpt", "--to-orbax", "out/orbax"]) == 0
        assert main(["convert", "--load", "ckpt", "--to-hf", "hf/gpt2"]) == 0
        assert main(["convert", "--from-hf", PLACEHOLDERS["path/to/bert-dir"], "--save", "runs/bert-ckpt"]) == 0
    for split, n in (("train", 32), ("valid", 8)):
        (ws / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": f"{'good fine great' if i % 2 else 'bad poor awful'} {i}", "label": i % 2}) + "\n"
            for i in range(n)))
    return ws


def _in_user_dir(workspace: Path, tmp_path: Path) -> Path:
    """A copy of the working directory for one command, so that what it writes (a save, an
    export) is its own."""
    return Path(shutil.copytree(workspace, tmp_path / "user", symlinks=True))


def _curl_body() -> dict:
    """The JSON the page's curl line posts to the server."""
    page = (ROOT / "docs" / "generation.md").read_text()
    return json.loads(re.search(r"curl -s \S+ -d '(.*)'", page).group(1))


def _marks(argv: tuple[str, ...]) -> list:
    return [pytest.mark.slow] + ([] if " ".join(argv) in IN_CI else [pytest.mark.e2e])


def test_every_documented_command_is_run_here_or_elsewhere():
    """A new command line on a page needs no new test, but one this file can shrink: a
    cluster's config it has no size for fails here, in make test."""
    assert len(DOCUMENTED) > 25 and TORCHRUN, (len(DOCUMENTED), TORCHRUN)
    for _, argv in DOCUMENTED:
        parse_args(shrunk(list(argv)))
    assert {" ".join(argv) for _, argv in DOCUMENTED} >= IN_CI
    for flags, test in ELSEWHERE.items():  # the matrix row that types it holds those flags
        assert any(" ".join(argv).endswith(flags) for _, argv in DOCUMENTED), (flags, test)


@pytest.mark.parametrize("page,argv", [pytest.param(page, argv, marks=_marks(argv)) for page, argv in DOCUMENTED],
                         ids=[f"{page}:{' '.join(argv)[:70]}" for page, argv in DOCUMENTED])
def test_documented_command_runs(page, argv, workspace, tmp_path):
    user = _in_user_dir(workspace, tmp_path)
    command = shrunk(list(argv))
    args = parse_args(command)
    if args.command == "serve":
        port = command.index("--port")
        with serving(command[1:port] + command[port + 2:], cwd=user) as url:
            request = urllib.request.Request(url, data=json.dumps(_curl_body()).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                answer = json.load(response)
        assert answer["choices"][0]["text"], answer
        return
    if CUDA_ONLY in " ".join(argv) and not torch.cuda.is_available():  # the page says CUDA; refused here
        proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *command], cwd=user, env=env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-3000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and "CUDA" in proc.stderr, proc.stderr
        return
    proc = run_py(*command, cwd=user)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if args.command in ("train", "finetune"):
        steps = int(command[len(command) - 1 - command[::-1].index("--steps") + 1])
        assert re.search(rf"^(\[rank 0\] )?step {steps}\b", proc.stdout, re.M), proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("page,words", TORCHRUN, ids=[f"{page}:{' '.join(w)[:70]}" for page, w in TORCHRUN])
def test_documented_multi_node_command_runs(page, words, workspace, tmp_path):
    """The page's ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
    --rdzv-endpoint HOST:29500 run.py ...`` as two nodes on this machine: two launchers meet
    at a local endpoint (the first hosts the store), each starting half of the shrunk mesh."""
    user = _in_user_dir(workspace, tmp_path)
    command = shrunk(words[words.index("run.py") + 1:])
    world = 1
    for size in re.findall(r"\d+", command[command.index("--mesh") + 1]):
        world *= int(size)
    launcher = words[1:words.index("run.py")]
    settings = dict(zip(launcher[::2], launcher[1::2]))
    assert settings["--rdzv-backend"] == "c10d" and int(settings["--nnodes"]) >= 2, settings
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", str(world // 2), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", endpoint, "--rdzv-conf", f"is_host={str(node == 0).lower()}",
                               str(ROOT / "run.py"), *command], cwd=user, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in range(2)]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    assert re.search(rf"step {2 * TRAINED if '--load' in command else TRAINED}\b", "".join(outputs))
