"""FLOPs per token, MFU arithmetic, and sampling."""

import torch

from fxmega.inference.generate import sample_next
from fxmega.models import gpt
from fxmega.training.metrics import Peak, Throughput, known_peak, measure_peak, model_flops_per_token


def test_gpt2_flops_per_token_matches_palm_formula():
    assert model_flops_per_token(gpt.param_specs(gpt.Config()), gpt.Config(), 1024) == 855_166_464


def test_throughput_and_mfu():
    meter = Throughput(flops_per_token=1000, peak=Peak(1e6, "test"))
    rates = meter.step(tokens=500, seconds=1.0)
    assert rates == {"tokens_per_s": 500.0, "mfu": 0.5}
    meter.step(tokens=1500, seconds=1.0)
    assert meter.interval()["tokens_per_s"] == 1000.0  # 2000 tokens over 2 s


def test_peak_on_cpu_is_measured_and_says_so():
    assert known_peak(torch.device("cpu"), torch.float32) is None
    peak = measure_peak(torch.device("cpu"), torch.float32, size=256, seconds=0.05)
    assert peak.flops > 1e8 and "measured" in peak.source


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    logits = torch.randn(4, 50)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(sample_next(logits, 1.0, 0, g()), sample_next(logits, 1.0, 0, g()))
    assert torch.equal(sample_next(logits, 1.0, 1, g()), logits.argmax(-1))
