"""Self-describing checkpoints: a checkpoint records its model config and carries its
tokenizer's files, so ``run.py generate|eval --load CKPT`` needs nothing else — for one
saved by training and for one converted from a Hugging Face directory — while a checkpoint
written before they described themselves still loads with ``--config``."""

import json
import shutil

import pytest
import torch

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.core import tree
from fxmega.data import vocab_files as vf
from fxmega.data.tokenizer import build_tokenizer
from fxmega.inference.generate import generate_cached
from fxmega.models import gpt
from fxmega.ops.init import init_params
from fxmega.storage import checkpoint
from fxmega.storage.convert import from_hf
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")

DATA = ROOT / "data"
PROMPT = "hello world"
GREEDY = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def gpt2_bpe(tmp_path_factory):
    """GPT-2's BPE as a Hugging Face directory ships it: vocab.json and merges.txt."""
    folder = tmp_path_factory.mktemp("bpe")
    shutil.copyfile(vf.ensure_file(vf.GPT2_ENCODER_JSON, DATA), folder / "vocab.json")
    shutil.copyfile(vf.ensure_file(vf.GPT2_VOCAB_BPE, DATA), folder / "merges.txt")
    return folder


def _completion(cfg: gpt.Config, params: dict, tokenizer) -> str:
    ids = generate_cached(gpt.FAMILY, params, cfg, [tokenizer.encode(PROMPT)], 6)[0]
    return PROMPT + tokenizer.decode(ids)


def _meta(root) -> dict:
    return json.loads((checkpoint.resolve(root) / "meta.json").read_text())


def test_a_trained_checkpoint_generates_with_load_alone(tmp_path, gpt2_bpe, capsys):
    bpe = tmp_path / "bpe"
    shutil.copytree(gpt2_bpe, bpe)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    ckpt = tmp_path / "ckpt"
    train = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--set", "model.vocab_size=50257", "--data-path",
             str(corpus), "--tokenizer", f"gpt2-bpe:{bpe}", "--steps", "2", "--no-compile", "--no-progress"]
    assert main([*train, "--save", str(ckpt)]) == 0
    meta = _meta(ckpt)
    assert meta["tokenizer"] == "gpt2-bpe:{checkpoint}" and meta["config"]["model"]["family"] == "gpt"
    shutil.rmtree(bpe)  # the checkpoint holds its own copies
    capsys.readouterr()

    assert main(["generate", "--load", str(ckpt), *GREEDY]) == 0
    out = capsys.readouterr().out
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["model.vocab_size=50257"])
    step = checkpoint.resolve(ckpt)
    params = init_params(gpt.param_specs(cfg.model), 0)
    checkpoint.load(step, {f"params.{p}": t for p, t in tree.items(params)})
    assert _completion(cfg.model, params, build_tokenizer(f"gpt2-bpe:{gpt2_bpe}")) in out
    assert main(["eval", "--load", str(ckpt), "--eval-iters", "1", "--no-compile"]) == 0  # its data, from the record
    assert "perplexity" in capsys.readouterr().out


def test_a_converted_hugging_face_gpt2_generates_with_load_alone(tmp_path, gpt2_bpe, capsys):
    hf_cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.GPT2LMHeadModel(hf_cfg).save_pretrained(hf_dir, safe_serialization=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_bpe / name, hf_dir / name)
    _, cfg, params = from_hf(hf_dir)
    expected = _completion(cfg, params, build_tokenizer(f"gpt2-bpe:{hf_dir}"))

    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_dir), "--save", str(ckpt)]) == 0
    meta = _meta(ckpt)
    assert meta["tokenizer"] == "gpt2-bpe:{checkpoint}"
    assert sorted(meta["imported_from"]["files"]) == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]
    shutil.rmtree(hf_dir)
    capsys.readouterr()
    assert main(["generate", "--load", str(ckpt), *GREEDY]) == 0
    assert expected in capsys.readouterr().out


def test_a_checkpoint_from_before_still_loads_with_config(tmp_path, capsys):
    cfg = load(ROOT / "configs" / "tiny_gpt.py")
    params = init_params(gpt.param_specs(cfg.model), 3)
    old = tmp_path / "old"
    # what convert wrote before checkpoints described themselves: parameters, no config, no tokenizer
    checkpoint.save(old, 0, {f"params.{p}": t for p, t in tree.items(params)}, {"step": 0, "params_only": True})
    assert main(["generate", "--load", str(old), *GREEDY]) == 2
    err = capsys.readouterr().err
    assert "records no model config" in err and "give --config FILE" in err
    assert main(["generate", "--config", str(ROOT / "configs" / "tiny_gpt.py"), "--load", str(old), *GREEDY]) == 0
    assert _completion(cfg.model, params, build_tokenizer("byte")) in capsys.readouterr().out
