"""Sequence classification: the JSON-lines loader (labels, truncation, padding, errors with
FILE:LINE), deterministic batches, last-token pooling, fine-tuning BERT/GPT/Llama on a
separable task until validation is well above chance, and checkpoints in and out."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from fxmega.cli.commands import finetune_config
from fxmega.cli.parser import parse_args
from fxmega.config import load
from fxmega.core import tree
from fxmega.core.errors import ConfigError, DataError
from fxmega.data.classification import load_classification
from fxmega.data.mlm import specials_for
from fxmega.data.tokenizer import build_tokenizer
from fxmega.models import gpt, llama
from fxmega.models.classifier import classifier
from fxmega.models.family import ModelFamily
from fxmega.models.pieces import run_pieces
from fxmega.ops import init
from fxmega.ops.objectives import classification_eval
from fxmega.ops.recompute import plain_call
from fxmega.training import finetune as ft
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.tolerance import assert_within_rounding, forward_lengths, run_rtol

BYTES = build_tokenizer("byte")


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _separable(n: int, seed: int) -> list[dict]:
    """Class "low" texts use letters a..m, "high" ones n..z: any letter gives the class away."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["low", "high"])
        letters = "abcdefghijklm" if label == "low" else "nopqrstuvwxyz"
        rows.append({"text": "".join(rng.choice(letters) for _ in range(rng.randint(3, 12))), "label": label})
    return rows


def _cfg(name: str, **train):
    cfg = load(ROOT / "configs" / f"{name}.py")
    train = {"compile": False, "device": "cpu", "seq_len": 16, "micro_batch_size": 16, "global_batch_size": 16,
             "steps": 40, "log_interval": 20, "eval_interval": 0, **train}
    t = dataclasses.replace(cfg.train, **train)
    optim = dataclasses.replace(cfg.optim, lr=3e-3, min_lr=3e-4, warmup_steps=5, weight_decay=0.01)
    return dataclasses.replace(cfg, train=t, optim=optim)


# ---- the loader ------------------------------------------------------------------------------

def test_string_labels_bert_rows(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"text": "hi", "label": "pos"}, {"text": "abcdefghij", "label": "neg"},
                                         "", {"text": "ok", "label": "pos"}])
    specials = specials_for(BYTES, 259)
    data = load_classification(path, BYTES, 8, 259, specials=specials, valid_path=path)
    assert data.labels == ["neg", "pos"]  # sorted: neg -> 0, pos -> 1
    assert "'neg'->0, 'pos'->1" in data.description
    b = data.valid.eval_batches(4)[0]
    assert b["targets"].tolist() == [1, 0, 1, 1]  # three real examples, then example 0 again as padding
    assert b["loss_mask"].tolist() == [1, 1, 1, 0]
    assert b["inputs"][0].tolist() == [256, ord("h"), ord("i"), 257, 0, 0, 0, 0]
    assert b["inputs"][1].tolist() == [256, *b"abcdef", 257]  # truncated to seq_len with [CLS] and [SEP]
    assert b["attention_mask"].sum(1).tolist()[:3] == [4, 8, 4]
    assert b["token_types"].abs().sum() == 0


def test_int_labels_no_specials(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"text": "abc", "label": 2}, {"text": "defghijk", "label": 0}])
    data = load_classification(path, BYTES, 5, 256, valid_path=path, n_classes=4)
    assert data.labels == [0, 1, 2, 3]
    b = data.valid.eval_batches(2)[0]
    assert b["inputs"].tolist() == [[*b"abc", 0, 0], [*b"defgh"]] and "token_types" not in b
    assert b["targets"].tolist() == [2, 0]
    with pytest.raises(DataError, match=r"t.jsonl:1: label 2 is not one of the classes \(0..1\)"):
        load_classification(path, BYTES, 5, 256, valid_path=path, n_classes=2)


@pytest.mark.parametrize("line, message", [
    ('{"text": "a", "label": 0', r"bad.jsonl:2 is not valid JSON"),
    ('{"text": "a"}', r'bad.jsonl:2 needs an object with "text" and "label"'),
    ('{"text": 5, "label": 0}', r'bad.jsonl:2: "text" must be a string'),
    ('{"text": "a", "label": true}', r'bad.jsonl:2: "label" must be an integer or a string'),
    ('{"text": "a", "label": "x"}', r"labels mix integers \(.*bad.jsonl:1: 0\) and strings \(.*bad.jsonl:2"),
    ('{"text": "", "label": 1}', r"bad.jsonl:2: the text is empty"),
    ('{"text": "a", "label": -1}', r"bad.jsonl:2: label -1 is not one of the classes"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", ['{"text": "b", "label": 0}', line])
    with pytest.raises(DataError, match=message):
        load_classification(path, BYTES, 8, 256, valid_path=path)


def test_valid_label_unknown_and_vocab_checks(tmp_path):
    train = _write(tmp_path / "t.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    valid = _write(tmp_path / "v.jsonl", [{"text": "a", "label": "z"}])
    with pytest.raises(DataError, match=r"v.jsonl:1: label 'z' is not one of the classes \('x', 'y'\)"):
        load_classification(train, BYTES, 8, 256, valid_path=valid)
    with pytest.raises(DataError, match=r"t.jsonl:1: token id 97 is outside the 64 ids"):
        load_classification(train, BYTES, 8, 64, valid_path=train)
    with pytest.raises(ConfigError, match="n_classes=1 but the data has 2 distinct labels"):
        load_classification(train, BYTES, 8, 256, valid_path=train, n_classes=1)


def test_batches_are_deterministic_epochs_and_split(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"text": f"t{i}", "label": i % 3} for i in range(40)])
    a = load_classification(path, BYTES, 4, 256, valid_fraction=0.25, seed=7)
    b = load_classification(path, BYTES, 4, 256, valid_fraction=0.25, seed=7)
    assert len(a.train) == 30 and len(a.valid) == 10
    assert torch.equal(a.train.global_batch(5, 6)["inputs"], b.train.global_batch(5, 6)["inputs"])
    # one epoch (5 steps of 6) sees every training example exactly once
    seen = torch.cat([a.train.global_batch(s, 6)["inputs"] for s in range(5)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, a.train.inputs.tolist()))
    train_rows = set(map(tuple, a.train.inputs.tolist()))
    assert not train_rows & set(map(tuple, a.valid.inputs.tolist()))  # disjoint splits
    batches = a.valid.eval_batches(4)
    assert [int(x["loss_mask"].sum()) for x in batches] == [4, 4, 2]


# ---- pooling ---------------------------------------------------------------------------------

def _pooled(family: ModelFamily, model: ModelFamily, params: dict, tokens: torch.Tensor, mask: torch.Tensor,
            mcfg) -> torch.Tensor:
    x = run_pieces(model, params, params, tokens, mcfg, plain_call, head=False, valid=mask)
    return family.pool(params, x, mask, mcfg)


@pytest.mark.parametrize("module, name", [(gpt, "tiny_gpt"), (llama, "tiny_llama")])
def test_last_token_pooling_ignores_padding(module, name):
    mcfg = load(ROOT / "configs" / f"{name}.py").model
    model = classifier(module.FAMILY, mcfg, 2)
    params = init.init_params(model.param_specs(mcfg), 0)
    tokens = torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out = _pooled(module.FAMILY, model, params, tokens, mask, mcfg)
    changed = tokens.clone()
    changed[0, 3:] = torch.tensor([40, 41])  # other padding tokens
    again = _pooled(module.FAMILY, model, params, changed, mask, mcfg)
    torch.testing.assert_close(out, again)
    # the padded row pools position 2: the same vector as the unpadded 3-token text
    alone = _pooled(module.FAMILY, model, params, tokens[:1, :3], mask[:1, :3], mcfg)
    # the 5-position batch attends over 5 slots (2 masked), the alone one over 3: other orders
    assert_within_rounding(out[:1], alone, forward_lengths(mcfg, 5), what="pooled")
    assert not torch.allclose(out[0], out[1])
    logits = run_pieces(model, params, params, tokens, mcfg, plain_call, valid=mask, head_inputs=[mask])
    assert logits.shape == (2, 2) and logits.dtype == torch.float32
    w = params["classifier"]
    torch.testing.assert_close(logits, out @ w["w"] + w["b"])  # the head is the pooled vector's linear map
    both, count = classification_eval(2)(logits, {"targets": logits.argmax(-1), "loss_mask": torch.ones(2)})
    assert both[1].item() == 2.0 and count.item() == 2.0  # its own argmax is right every time


def test_classifier_specs_axes():
    mcfg = load(ROOT / "configs" / "tiny_llama.py").model
    specs = classifier(llama.FAMILY, mcfg, 3).param_specs(mcfg)
    head = specs["classifier"]
    assert head["w"].shape == (64, 3) and head["w"].axes == ("embed", "classes") and head["b"].axes == ("classes",)
    assert "head" not in specs  # the LM head is outside the loss


# ---- fine-tuning -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("task")
    return _write(folder / "train.jsonl", _separable(200, 0)), _write(folder / "valid.jsonl", _separable(60, 1))


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt", "tiny_llama"])
def test_finetune_learns_separable_task(task, name):
    out = ft.finetune(_cfg(name), task[0], task[1], tokenizer=BYTES)
    assert out["labels"] == ["high", "low"]
    assert len(out["train_losses"]) == 40
    assert out["valid_accuracy"] >= 0.8, out
    assert out["valid_loss"] < math.log(2), out


def test_save_then_load_continues_exactly(task, tmp_path):
    cfg = _cfg("tiny_gpt", steps=10, save_dir=str(tmp_path / "ckpt"))
    first = ft.finetune(cfg, task[0], task[1], tokenizer=BYTES)
    assert first["checkpoint"].endswith("step_00000010")
    # lr 0: the loaded model and classifier are evaluated unchanged
    frozen = dataclasses.replace(_cfg("tiny_gpt", steps=1), optim=dataclasses.replace(cfg.optim, lr=0.0, min_lr=0.0))
    again = ft.finetune(frozen, task[0], task[1], load=str(tmp_path / "ckpt"), tokenizer=BYTES)
    # the same parameters and batches; only the loaded run's compiled graph may fuse differently
    assert again["valid_loss"] == pytest.approx(first["valid_loss"], rel=run_rtol(cfg, 1))
    for a, b in zip(tree.leaves(first["params"]), tree.leaves(again["params"])):
        torch.testing.assert_close(a, b)


def test_load_language_model_checkpoint(task, tmp_path):
    run = Run(_cfg("tiny_llama"))
    run.save(str(tmp_path / "lm"))
    frozen = dataclasses.replace(_cfg("tiny_llama", steps=1), optim=dataclasses.replace(run.cfg.optim, lr=0.0,
                                                                                        min_lr=0.0))
    out = ft.finetune(frozen, task[0], task[1], load=str(tmp_path / "lm"), tokenizer=BYTES)
    torch.testing.assert_close(out["params"]["blocks"][1]["mlp"]["w_up"], run.params["blocks"][1]["mlp"]["w_up"])
    # the head is new: a checkpoint without one leaves the seeded init
    assert torch.equal(out["params"]["classifier"]["b"], torch.zeros(2))


def test_load_hugging_face_bert_dir(task, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BertConfig(vocab_size=259, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=32)
    transformers.BertModel(hf_cfg).save_pretrained(tmp_path / "hf")  # BertModel: with the pooler
    frozen = _cfg("tiny_bert", steps=1)
    frozen = dataclasses.replace(frozen, optim=dataclasses.replace(frozen.optim, lr=0.0, min_lr=0.0))
    out = ft.finetune(frozen, task[0], task[1], load=str(tmp_path / "hf"), tokenizer=BYTES)
    params = out["params"]
    assert params["blocks"][0]["mlp"]["w_in"].shape == (32, 37) and "pooler" in params and "mlm" not in params
    from safetensors.torch import load_file

    hf_words = load_file(str(tmp_path / "hf" / "model.safetensors"))["embeddings.word_embeddings.weight"]
    torch.testing.assert_close(params["embed"]["tokens"], hf_words)


def test_config_errors(task):
    cfg = _cfg("tiny_gpt")
    with pytest.raises(ConfigError, match="compute.loss_chunk=4 chunks the projection onto the vocabulary"):
        ft.finetune(dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, loss_chunk=4)), *task)


def test_fp16_finetune_scales_the_loss_and_learns(task):
    # the fine-tune is a Run, so fp16 gets the pre-training loss scaler (once refused here)
    cfg = _cfg("tiny_gpt")
    cfg = dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, precision="fp16"))
    job = ft.FineTune(cfg, *task, tokenizer=BYTES)
    assert job.run.scaler is not None
    out = ft.finetune(cfg, *task, tokenizer=BYTES)
    assert all(math.isfinite(x) for x in out["train_losses"])
    assert out["valid_accuracy"] >= 0.8, out


def test_finetune_command_line(tmp_path, capsys):
    from fxmega.cli import main

    train = _write(tmp_path / "train.jsonl", _separable(120, 5))
    valid = _write(tmp_path / "valid.jsonl", _separable(40, 6))
    code = main(["finetune", "--config", str(ROOT / "configs" / "tiny_gpt.py"), "--data-path", train, "--valid-path",
                 valid, "--no-compile", "--steps", "30", "--seq-length", "16", "--micro-batch-size", "16",
                 "--global-batch-size", "16", "--lr", "3e-3", "--device", "cpu", "--log-interval", "10",
                 "--eval-interval", "15", "--log-jsonl", str(tmp_path / "log.jsonl")])
    assert code == 0
    out = capsys.readouterr().out
    accuracy = float(out.split("valid accuracy ")[1].split()[0])
    assert accuracy >= 0.8 and "over labels ['high', 'low']" in out
    # one record per step, as pre-training writes; batch accuracy on log steps, validation on its own
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["lr"] > 0 for r in records)
    assert [r["step"] for r in records if "batch_accuracy" in r] == [10, 20, 30]
    assert [r["step"] for r in records if "valid_accuracy" in r] == [15, 30]
    assert abs(records[-1]["valid_accuracy"] - accuracy) <= 5e-4  # printed to 3 decimals
    assert main(["finetune", "--config", str(ROOT / "configs" / "tiny_gpt.py")]) == 2
    assert "finetune needs --data-path TRAIN.jsonl" in capsys.readouterr().err



def test_finetune_command_takes_the_checkpoints_model(tmp_path):
    """docs/generation.md: ``finetune --config configs/tiny_bert.py --load runs/bert-ckpt``, the
    checkpoint a 384-wide converted BERT. The model and tokenizer are the checkpoint's, the
    training the config's (the shapes once disagreed at load)."""
    saved = dataclasses.replace(_cfg("tiny_llama"), data=dataclasses.replace(_cfg("tiny_llama").data,
                                                                            tokenizer="byte"))
    Run(saved).save(str(tmp_path / "lm"))
    argv = ["finetune", "--config", str(ROOT / "configs" / "tiny_bert.py"), "--load", str(tmp_path / "lm"),
            "--steps", "7"]
    cfg = finetune_config(parse_args(argv))
    assert cfg.model == saved.model and cfg.data.tokenizer == "byte" and cfg.train.steps == 7
    assert cfg.optim == load(str(ROOT / "configs" / "tiny_bert.py")).optim
    chosen = finetune_config(parse_args(argv + ["--tokenizer", "char"]))
    assert chosen.model == saved.model and chosen.data.tokenizer == "char"
    # no --load: the config's own model
    assert finetune_config(parse_args(argv[:3])).model == load(str(ROOT / "configs" / "tiny_bert.py")).model

# ---- on a mesh ---------------------------------------------------------------------------------
# name -> (model config, parallel settings); one micro batch of 8 per data rank and step
FINETUNE_MESHES = {
    "gpt_dp2": ("tiny_gpt", dict(mesh="dp=2")),
    "gpt_dp2_zero3": ("tiny_gpt", dict(mesh="dp=2", rules="zero3")),
    "gpt_tp2": ("tiny_gpt", dict(mesh="tp=2")),
    "bert_tp2": ("tiny_bert", dict(mesh="tp=2")),
    # two micro batches through two stages: the last one pools with the attention mask it is given
    "gpt_pp2": ("tiny_gpt", dict(mesh="pp=2")),
    "bert_pp2": ("tiny_bert", dict(mesh="pp=2")),
}
MESH_STEPS = 6


def _mesh_cfg(name: str, parallel: dict | None = None):
    cfg = _cfg(name, steps=MESH_STEPS, micro_batch_size=8, global_batch_size=16, log_interval=MESH_STEPS)
    return cfg if parallel is None else dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                                              **parallel))


def _record_finetune(cfg, train_path: str, valid_path: str) -> dict:
    """What every parity test records (``tests.parity.record``: losses, gradient norms,
    first-step gradients, final parameters), and the validation loss and accuracy."""
    from tests.parity import record

    job = ft.FineTune(cfg, train_path, valid_path, tokenizer=BYTES)
    out = record(job.run, MESH_STEPS)
    out["valid_loss"], out["valid_accuracy"] = job.validate()
    return out


def finetune_on_meshes(names: list[str], train_path: str, valid_path: str) -> dict | None:
    """Each run of ``names`` on this rank's mesh, recorded (rank 0 returns them)."""
    out = {name: _record_finetune(_mesh_cfg(*FINETUNE_MESHES[name]), train_path, valid_path) for name in names}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.slow
def test_finetune_on_dp_zero3_tp_and_pp_matches_one_device(task):
    from tests.multirank import run_ranks
    from tests.parity import assert_matches_one_device

    got = run_ranks(2, "tests.test_finetune:finetune_on_meshes", list(FINETUNE_MESHES), *task)[0]
    for model in ("tiny_gpt", "tiny_bert"):
        cfg = _mesh_cfg(model)
        ref = _record_finetune(cfg, *task)
        for name, (m, _) in FINETUNE_MESHES.items():
            if m != model:
                continue
            # losses and gradient norms per step, every gradient after step 1, the parameters after the last
            assert_matches_one_device(got[name], ref, cfg, name)
            assert got[name]["valid_loss"] == pytest.approx(ref["valid_loss"], rel=run_rtol(cfg, MESH_STEPS + 1))
            assert got[name]["valid_accuracy"] == ref["valid_accuracy"]
