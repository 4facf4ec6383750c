"""T5 pre-training by span corruption through the same Run as every family: the corrupted
batches have T5's statistics, the loss falls, and sharded runs (DP, ZeRO-3, TP with sequence
parallelism, one of them compiled with inductor) equal one device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fxmega.cli import main
from fxmega.config import load, override
from fxmega.core.errors import ConfigError
from fxmega.data.span_corruption import SpanSpecials, corrupt, lengths, noise_mask, raw_length, span_batch
from fxmega.inference.generation_cli import load_generator
from fxmega.inference.model_loader import recorded, recorded_config
from fxmega.inference.seq2seq import generate_seq2seq
from fxmega.models import t5
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.multirank import ROOT, run_ranks
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import t5_config
from tests.tiers import inductor_in_e2e

T5 = ROOT / "configs" / "tiny_t5.py"
SPECIALS = SpanSpecials(pad=1000, eos=1001, sentinels=tuple(range(1099, 999, -1)))


def test_noise_masks_have_t5s_density_and_span_lengths():
    rng = np.random.default_rng(0)
    raw, rows = 568, 400  # T5's 512-token source: 568-token windows (compute_input_and_target_lengths)
    assert raw_length(512, 114) == raw and lengths(raw)[2:] == (512, 114)
    masks = np.stack([noise_mask(rng, raw) for _ in range(rows)])
    assert (masks.sum(axis=1) == round(raw * 0.15)).all()  # exactly the noise count in every window
    assert not masks[:, 0].any()  # a window starts with kept tokens
    starts = masks & ~np.concatenate([np.zeros((rows, 1), bool), masks[:, :-1]], axis=1)
    assert (starts.sum(axis=1) == round(round(raw * 0.15) / 3)).all()  # the span count
    # mean span length is noise / spans exactly; spans are random: their lengths vary (not all 3)
    span_lengths = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], masks[0].astype(int), [0]]))))[::2]
    assert span_lengths.mean() == pytest.approx(85 / 28) and span_lengths.min() >= 1
    assert len(set(span_lengths)) > 1
    # every position is noise with probability 0.15, apart from the first: over 400 x 567 draws
    # the mean is within 5 standard errors of it
    per_position = masks[:, 1:].mean()
    assert abs(per_position - 85 / 567) < 5 * np.sqrt(0.15 * 0.85 / masks[:, 1:].size)


def test_corruption_is_t5s_format_and_invertible():
    tokens = np.arange(20, 40)
    mask = np.zeros(20, bool)
    mask[[3, 4, 10, 15, 16, 17]] = True
    source, target = corrupt(tokens, mask, SPECIALS)
    assert source.tolist() == [20, 21, 22, 1099, 25, 26, 27, 28, 29, 1098, 31, 32, 33, 34, 1097, 38, 39, 1001]
    assert target.tolist() == [1099, 23, 24, 1098, 30, 1097, 35, 36, 37, 1001]
    batch = span_batch(np.stack([tokens, tokens]), np.random.default_rng(1), SPECIALS, 20, 8)
    assert batch["inputs"].shape == (2, 20) and batch["targets"].shape == (2, 8)
    # decoder inputs: the targets shifted right behind the start token (pad)
    assert torch.equal(batch["decoder_inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["decoder_inputs"][:, 0] == SPECIALS.pad).all()
    assert batch["attention_mask"].shape == (2, 28) and torch.equal(batch["loss_mask"],
                                                                    batch["attention_mask"][:, 20:].float())


def test_lengths_that_do_not_fit_are_refused():
    with pytest.raises(ConfigError, match="raise it to 114"):
        raw_length(512, 100)
    with pytest.raises(ConfigError, match="train.seq_len=16: for T5 it is the source length"):
        Run(override(load(T5), ["train.seq_len=16", "train.compile=false"]))


def test_span_corruption_loss_falls():
    run = Run(t5_config(extra=("train.steps=40",)))
    losses = [run.do_step()["loss"] for _ in range(40)]
    # the mock sequences count up by a stride, so the dropped spans are predictable from their
    # context: a nat below uniform over the vocabulary within 40 steps (4.1 measured, 5.5 at first)
    assert np.mean(losses[-5:]) < np.log(t5_config().model.vocab_size) - 1


T5_MESHES = {
    # inductor under make e2e: fused kernels with the collectives; aot_eager under make test (tests/tiers.py)
    "dp2": (dict(mesh="dp=2"), ("train.compile=true", *inductor_in_e2e())),
    "zero3": (dict(mesh="dp=2", rules="zero3"), ()),
    "tp2_sp": (dict(mesh="tp=2", sequence_parallel=True), ()),
}
STEPS = 3


@pytest.fixture(scope="module")
def one_device():
    run = Run(t5_config())
    return record(run, STEPS), run.cfg


@pytest.fixture(scope="module")
def meshes():
    return run_ranks(2, "tests.sharding_workers:t5_span_corruption", T5_MESHES, STEPS)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(T5_MESHES))
def test_t5_on_a_mesh_matches_one_device(meshes, one_device, name):
    ref, cfg = one_device
    # the mesh sums in other orders: losses, gradient norms, every gradient, parameters
    assert_matches_one_device(meshes[name], ref, cfg, name)


def test_t5_refuses_pipeline_and_context_parallelism():
    for mesh in ("pp=2", "cp=2"):
        cfg = t5_config(dict(mesh=mesh))
        with pytest.raises(ConfigError, match=f"does not split over {mesh[:2]}"):
            t5.check_mesh(cfg.model, MeshSpec.parse(mesh))


def test_train_then_generate_commands(tmp_path, capsys):
    """run.py train saves a T5 checkpoint that describes itself; run.py generate --load it
    alone prints each source's target, sentinels written as T5 writes them, the tokens the
    library's greedy decoding gives."""
    words = "the quick brown fox jumps over the lazy dog".split()
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(words, 4000)))
    ckpt = tmp_path / "ckpt"
    assert main(["train", "--config", str(T5), "--data-path", str(tmp_path / "corpus.txt"), "--no-compile",
                 "--steps", "6", "--save", str(ckpt)]) == 0
    prompt = "the quick <extra_id_0> fox"
    capsys.readouterr()
    assert main(["generate", "--load", str(ckpt), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    run = load_generator(override(recorded_config(*recorded(str(ckpt))), [f"train.load_dir={ckpt}"]))
    source = run.tokenizer.encode(prompt) + [run.cfg.model.eos_id]  # sources end in EOS, as in training
    assert source[-6] == run.cfg.model.sentinel(0) and len(source) == len(prompt) - len("<extra_id_0>") + 2
    ids = generate_seq2seq(t5, run.params, run.cfg.model, [source], 8)[0]
    assert f"{prompt}\n=> {run.tokenizer.decode(ids)}\n" in out
    # refused before any rank starts
    assert main(["generate", "--load", str(ckpt), "--prompt", prompt, "--mesh", "tp=2"]) != 0
    assert "encoder-decoder on one device; drop --mesh tp=2" in capsys.readouterr().err
