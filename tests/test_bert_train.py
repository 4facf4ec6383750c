"""BERT pre-training (masked LM) through the same Run: the loss falls, sharded runs (DP with
ZeRO, TP) match one device, and Hugging Face BERT directories convert to checkpoints."""

import numpy as np
import pytest
import torch

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.data.corpus import ensure_shakespeare
from fxmega.training.run import Run
from tests.multirank import ROOT, run_ranks
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import bert_config
from tests.tolerance import assert_losses_match, run_rtol

BERT = ROOT / "configs" / "tiny_bert.py"


def _run(*extra: str, steps: int) -> tuple[list[float], Run]:
    run = Run(override(load(BERT), ["train.compile=false", "train.device=cpu", *extra]))
    return [run.do_step()["loss"] for _ in range(steps)], run


def unigram_entropy(path) -> float:
    """Entropy in nats of the file's bytes: the masked-LM loss of a model that knows the byte
    frequencies and nothing of the context (the masked positions are drawn uniformly)."""
    counts = np.bincount(np.frombuffer(path.read_bytes(), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_masked_lm_learns_context_on_shakespeare():
    # 32 x 64 tokens per step (about 300 masked), 150 eager steps on the real corpus
    corpus = ensure_shakespeare(ROOT / "data")
    entropy = unigram_entropy(corpus)  # 3.33 nats; uniform over the 256 bytes is 5.55
    extra = ("data.source=shakespeare", f"data.data_dir={ROOT / 'data'}", "train.global_batch_size=32",
             "train.micro_batch_size=32", "train.seq_len=64", "optim.lr=3e-3", "optim.warmup_steps=10",
             "train.steps=150", "train.eval_iters=8")
    losses, run = _run(*extra, steps=150)
    assert sum(losses[:10]) / 10 > entropy + 1  # it starts near uniform
    # below the unigram entropy: it predicts masked bytes from their context (3.06 measured)
    assert run.evaluate() < entropy


# Every mesh BERT trains on, against one device: the masked-LM objective (its loss mask and
# token types) must reach the loss wherever the model runs. The pipelines were the bug: the
# last stage summed the loss over every position and divided by the masked count (34.0
# against 5.575 at step 1).
BERT_MESHES = {
    "dp2_zero1": dict(mesh="dp=2", rules="zero1"),
    "zero3": dict(mesh="dp=2", rules="zero3"),
    "tp2": dict(mesh="tp=2"),
    "pp2_gpipe": dict(mesh="pp=2", pipeline_schedule="gpipe"),
    "pp2_1f1b": dict(mesh="pp=2"),
    "pp2_interleaved": dict(mesh="pp=2", pipeline_schedule="interleaved-1f1b", virtual_stages=2),
    "pp2_zero_bubble": dict(mesh="pp=2", pipeline_schedule="zero-bubble", virtual_stages=2),
}
STEPS = 4


@pytest.fixture(scope="module")
def one_device():
    run = Run(bert_config())
    return record(run, STEPS), run.evaluate(), run.cfg


@pytest.fixture(scope="module")
def meshes():
    return run_ranks(2, "tests.sharding_workers:bert_mlm", BERT_MESHES, STEPS)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BERT_MESHES))
def test_masked_lm_on_a_mesh_matches_one_device(meshes, one_device, name):
    ref, valid, cfg = one_device
    got = meshes[name]
    # the mesh sums in other orders: losses, gradient norms, every gradient, parameters
    assert_matches_one_device(got, ref, cfg, name)
    assert got["valid"] == pytest.approx(valid, rel=run_rtol(cfg, STEPS + 1))


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


def test_bert_recomputes_its_blocks_and_refuses_the_chunked_loss():
    # BERT runs as pieces (embedding, blocks, MLM head) like every family, so its blocks can
    # be recomputed; its head (a transform, then the tied projection plus a bias) is not the
    # final norm and one projection that the chunked loss fuses
    from fxmega.core.errors import ConfigError

    plain, run = _run(steps=3)
    for mode in ("selective", "full"):
        again, _ = _run(f"compute.recompute={mode}", steps=3)
        assert_losses_match(again, plain, run.cfg, mode)  # the same ops, recomputed in the backward
    with pytest.raises(ConfigError, match="compute.loss_chunk=16: the bert head is not a final norm"):
        _run("compute.loss_chunk=16", steps=0)
