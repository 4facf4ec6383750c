"""BERT pre-training (masked LM) through the same Run: the loss falls, sharded runs (DP with
ZeRO, TP) match one device, and Hugging Face BERT directories convert to checkpoints."""

import pytest
import torch

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.train import Run
from tests.multirank import ROOT, run_ranks

BERT = ROOT / "configs" / "tiny_bert.py"


def _run(*extra: str, steps: int) -> tuple[list[float], Run]:
    run = Run(override(load(BERT), ["train.compile=false", "train.device=cpu", *extra]))
    return [run.do_step()["loss"] for _ in range(steps)], run


def test_masked_lm_loss_falls():
    # 32 x 64 tokens per step (about 300 masked); ln(256) = 5.55 at the start
    extra = ("train.global_batch_size=32", "train.micro_batch_size=32", "train.seq_len=64", "optim.lr=1e-3",
             "train.steps=100", "train.eval_iters=4")
    losses, run = _run(*extra, steps=100)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.04, (first, last)
    assert run.evaluate() < 5.50


@pytest.mark.parametrize("parallel", [dict(mesh="dp=2", rules="zero1"), dict(mesh="tp=2")], ids=["dp2_zero1", "tp2"])
def test_sharded_masked_lm_matches_one_device(parallel):
    ref, run = _run("train.micro_batch_size=4", steps=4)
    got = run_ranks(2, "tests.sharding_workers:bert_mlm", parallel, 4)[0]
    torch.testing.assert_close(got["losses"], ref, rtol=1e-5, atol=0)
    assert got["valid"] == pytest.approx(run.evaluate(), rel=1e-5)


def test_hugging_face_bert_converts_and_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.BertConfig(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(hf_cfg).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    losses, run = _run(f"train.load_dir={tmp_path / 'ckpt'}", steps=1)
    assert run.resume(str(tmp_path / "ckpt"), params_only=True)
    assert torch.isfinite(torch.tensor(losses)).all()


def test_compute_options_bert_cannot_honour_are_refused():
    from fxmega.errors import ConfigError

    for extra in ("compute.recompute=full", "compute.loss_chunk=16"):
        with pytest.raises(ConfigError, match="not implemented for BERT yet"):
            _run(extra, steps=0)
