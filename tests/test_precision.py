"""Mixed precision: bf16 and fp16 runs track fp32; fp16 loss scaling follows Megatron's
dynamic scaler (overflow → step skipped, scale halved, training goes on; the scaler state is
checkpointed); gradient reductions in bf16 on request; chunked cross-entropy equals the
plain one."""

from __future__ import annotations

import pytest
import torch

from fxmega.cli import config_from_args, parse_args
from fxmega.config import load, override
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.core.precision import LossScaler
from fxmega.models import gpt, llama
from fxmega.ops import layers, losses
from fxmega.ops.init import init_params
from fxmega.training.run import Run
from tests.multirank import ROOT, run_ranks
from tests.tolerance import assert_within_rounding, forward_lengths

STEPS = 30


def _run(*extra: str, steps: int = STEPS, model: str = "tiny_gpt") -> tuple[list[float], Run]:
    # train.steps stays the same whatever is run, so that every run has the same LR schedule
    cfg = override(load(ROOT / "configs" / f"{model}.py"),
                   ["train.compile=false", "train.device=cpu", f"train.steps={STEPS}", *extra])
    run = Run(cfg)
    return [run.do_step()["loss"] for _ in range(steps)], run


@pytest.fixture(scope="module")
def fp32_losses():
    return _run()[0]


def test_bf16_tracks_fp32(fp32_losses):
    bf16, run = _run("compute.precision=bf16")
    # measured: at most 1.4e-3 apart over 30 steps, while the loss falls by ~1.0
    assert max(abs(a - b) for a, b in zip(bf16, fp32_losses)) < 5e-3
    assert fp32_losses[0] - fp32_losses[-1] > 0.5
    # the masters and the optimizer state stay fp32
    assert all(p.dtype == torch.float32 for p in tree.leaves(run.params))
    assert all(m.dtype == torch.float32 for m in run.opt_state["exp_avg"])


@pytest.mark.slow
def test_fp16_with_loss_scaling_tracks_fp32(fp32_losses):
    fp16, run = _run("compute.precision=fp16", "compute.initial_loss_scale=4096")
    assert run.skipped_steps == 0 and run.scaler.scale == 4096
    assert max(abs(a - b) for a, b in zip(fp16, fp32_losses)) < 5e-3


@pytest.mark.slow
def test_fp16_default_scale_skips_overflowing_steps_until_the_scale_fits(capsys):
    # Megatron's start: 2^32 overflows; with hysteresis 2 the first two overflows keep the
    # scale, every later one halves it, until the gradients fit in fp16
    _, run = _run("compute.precision=fp16", steps=20)
    assert 2 < run.skipped_steps < 20 and run.scaler.scale < 2.0**32
    assert run.scaler.scale == 2.0**32 / 2 ** (run.skipped_steps - 1)
    assert "fp16 gradients overflowed at loss scale 4.29497e+09: the update was skipped" in capsys.readouterr().out


def test_fp16_overflow_injection_skips_the_step_and_halves_the_scale(monkeypatch):
    monkeypatch.setenv("FXMEGA_TEST_NAN_AT_STEP", "3")  # the loss of step 3 becomes NaN
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.compile=false", "train.device=cpu", "compute.precision=fp16",
                    "compute.initial_loss_scale=4096", "compute.hysteresis=1"])
    run = Run(cfg)
    results = [run.do_step() for _ in range(2)]
    before = [t.detach().clone() for t in tree.leaves(run.params)]
    moments = [t.clone() for t in run.opt_state["exp_avg"]]
    results.append(run.do_step())
    assert results[-1]["skipped"] and run.scaler.scale == 2048 and run.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tree.leaves(run.params)))  # not applied
    assert all(torch.equal(a, b) for a, b in zip(moments, run.opt_state["exp_avg"]))
    results += [run.do_step() for _ in range(3)]
    assert not any(r.get("skipped") for r in results[3:]) and results[-1]["loss"] < results[0]["loss"]


def test_loss_scaler_follows_megatron():
    s = LossScaler(initial=1024, min_scale=256, window=3, hysteresis=2)
    s.update(False)
    assert s.scale == 1024  # hysteresis: the first overflow is tolerated
    s.update(False)
    assert s.scale == 512
    s.update(False)
    assert s.scale == 256
    s.update(False)
    assert s.scale == 256  # never below the minimum
    for _ in range(3):
        s.update(True)
    assert s.scale == 512 and s.hysteresis_left == 2  # a clean window doubles and resets hysteresis
    s.update(False)
    assert s.scale == 512
    fixed = LossScaler(fixed=128)
    fixed.update(False)
    assert fixed.scale == 128 and fixed.overflows == 1


def test_loss_scale_is_checkpointed(tmp_path):
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.compile=false", "train.device=cpu", "compute.precision=fp16", "train.steps=30"])
    run = Run(cfg)
    for _ in range(18):
        run.do_step()
    run.save(str(tmp_path))
    run.finish_saves()
    state = run.scaler.state_dict()
    assert state["scale"] < 2.0**32
    resumed = Run(cfg)
    assert resumed.resume(str(tmp_path))
    assert resumed.scaler.state_dict() == state and resumed.skipped_steps == run.skipped_steps
    assert [resumed.do_step()["loss"] for _ in range(2)] == [run.do_step()["loss"] for _ in range(2)]


def test_chunked_cross_entropy_equals_plain():
    torch.manual_seed(0)
    h = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(16, 37, requires_grad=True)
    targets = torch.randint(0, 33, (3, 10))
    mask = (torch.rand(3, 10) > 0.3).float()
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    for vocab, m in ((37, None), (33, mask)):  # the second: 4 padding columns and a loss mask
        ref = layers.cross_entropy_sum(h64 @ w64, targets, m, vocab_size=vocab)  # float64: the exact answer
        ref_grads = torch.autograd.grad(ref, (h64, w64))
        for chunk in (1, 7, 30, 64):
            got = losses.chunked_cross_entropy_sum(h, w, targets, m, vocab, chunk)
            grads = torch.autograd.grad(got, (h, w))
            # the chain: logits over d=16, log-sum-exp over V=37, the sum over 30 positions. The
            # loss's terms are up to the largest logit z; dh sums (p - y) w over V (|p - y| sums
            # to at most 2), dw sums h (p - y) over 30 positions; a rounding error in a logit
            # becomes a relative error in p, so the gradients' scale carries a factor z
            z = max(1.0, float((h64 @ w64).abs().max()))
            assert_within_rounding(got, ref, (16, 37, 30), scale=30 * z, what=f"loss chunk {chunk}")
            scales = (2 * float(w.abs().max()) * z, 30 * float(h.abs().max()) * z)
            for name, g, r, scale in zip(("dh", "dw"), grads, ref_grads, scales):
                assert_within_rounding(g, r, (16, 37, 30), scale=scale, what=f"{name} chunk {chunk}")


def test_chunked_loss_in_a_run_equals_the_plain_loss(fp32_losses):
    chunked, _ = _run("compute.loss_chunk=48", steps=5)
    torch.testing.assert_close(chunked, fp32_losses[:5], rtol=1e-5, atol=0)


def test_bad_precision_settings_are_clear_errors():
    cfg = load(ROOT / "configs" / "tiny_gpt.py")
    for key, value, says in (("precision", "fp8", "use one of fp32, bf16, fp16"),
                             ("recompute", "some", "use one of none, selective, full"),
                             ("kernels", "cuda", "use one of reference, triton"),
                             ("grad_reduce", "fp16", "use fp32 or bf16"),
                             ("hysteresis", "0", "must be positive")):
        with pytest.raises(ConfigError, match=says):
            override(cfg, [f"compute.{key}={value}"]).validate()


def test_cli_precision_flags():
    cfg_path = str(ROOT / "configs" / "tiny_gpt.py")
    for argv, want in ((["--bf16"], ("bf16", "none")), (["--fp16", "--recompute", "full"], ("fp16", "full")),
                       (["--precision", "bf16", "--recompute", "selective"], ("bf16", "selective"))):
        cfg = config_from_args(parse_args(["--config", cfg_path, *argv]))
        assert (cfg.compute.precision, cfg.compute.recompute) == want


@pytest.mark.slow
def test_bf16_data_parallel_and_zero3_match_one_device():
    """2 gloo ranks, eager: dp with fp32 and with bf16 gradient reductions, ZeRO-3 (whose
    gather runs in bf16 and reduce-scatter in fp32), and the distributed optimizer with bf16
    reductions, against one bf16 device."""
    ref, _ = _run("compute.precision=bf16", "train.global_batch_size=8", "train.micro_batch_size=4", steps=4)
    got = run_ranks(2, "tests.sharding_workers:precision_variants", 4)[0]
    for name, result in got.items():
        tol = 2e-2 if name.endswith("bf16_reduce") else 5e-3
        assert max(abs(a - b) for a, b in zip(result, ref)) < tol, (name, result, ref)


@pytest.mark.parametrize("model, module", [("tiny_gpt", gpt), ("tiny_llama", llama)])
def test_padded_batch_attention_equals_each_sequence_alone(model, module):
    """Right-padded sequences through SDPA with a padding mask: the logits of every real
    token equal those of the sequence run alone, unpadded (the padding never leaks in)."""
    cfg = load(ROOT / "configs" / f"{model}.py").model
    params = init_params(module.param_specs(cfg), seed=0)
    torch.manual_seed(0)
    lengths = [12, 7, 3]
    tokens = torch.randint(0, cfg.vocab_size, (len(lengths), 12))
    valid = torch.zeros_like(tokens)
    for i, n in enumerate(lengths):
        valid[i, :n] = 1
        tokens[i, n:] = 0  # padding token: anything
    padded = module.forward(params, tokens, cfg, attention_mask=valid)
    for i, n in enumerate(lengths):
        alone = module.forward(params, tokens[i:i + 1, :n], cfg)
        # attention over 12 slots (some masked) against n: other orders of the same sums
        assert_within_rounding(padded[i, :n], alone[0], forward_lengths(cfg, 12), what=f"row {i}")
    assert torch.isfinite(padded).all()
    unmasked = module.forward(params, tokens, cfg)
    torch.testing.assert_close(unmasked, module.forward(params, tokens, cfg, valid.new_ones(valid.shape)))


@pytest.mark.slow
def test_pipeline_bf16_with_recompute_and_fp16_match_one_device():
    """pp=2 (eager): bf16 with full recompute tracks one bf16 device, fp16 (loss scaled
    through the schedule's loss function) tracks fp32."""
    from tests.sharding_workers import tiny_config

    runs = [("bf16", dict(mesh="pp=2"), False, ("compute.precision=bf16", "compute.recompute=full")),
            ("fp16", dict(mesh="pp=2"), False, ("compute.precision=fp16", "compute.initial_loss_scale=4096"))]
    got = run_ranks(2, "tests.pipeline_workers:pipelined", runs, 4)[0]
    for name, extra in (("bf16", ("compute.precision=bf16",)), ("fp16", ())):
        ref = Run(tiny_config(compile=False, extra=("model.n_layers=4", *extra)))
        ref_losses = [ref.do_step()["loss"] for _ in range(4)]
        assert max(abs(a - b) for a, b in zip(got[name]["losses"], ref_losses)) < 1e-3, (name, got[name], ref_losses)
