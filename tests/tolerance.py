"""Tolerances derived from the computation, never tuned on one machine.

The same floating-point computation done in another order (another CPU's SIMD width —
AVX2 against AVX-512/AMX —, another thread count, another rank layout or fusion) rounds
differently. A sum of ``n`` terms computed in any order is within ``n·eps·Σ|xᵢ|`` of the
exact sum (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2, with the unit
roundoff eps/2 doubled for the two orders being compared). A value that goes through a
chain of reductions (a matmul over ``d``, a softmax over ``V``, a mean over ``N`` tokens)
is bounded by the sum of their lengths times eps, relative to the magnitude of the terms.

So each comparison below states the reductions it goes through and the scale of their
terms; a float64 reference, where there is one, takes the place of the other fp32 order.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def rounding_bound(lengths: int | tuple[int, ...], scale: float, dtype: torch.dtype = torch.float32) -> float:
    """Absolute bound on the difference between two orders of a computation whose longest
    chain of reductions has these ``lengths``, with terms of magnitude up to ``scale``."""
    n = lengths if isinstance(lengths, int) else sum(lengths)
    return n * eps(dtype) * scale


def reduction_rtol(*lengths: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound for a value that goes through reductions of these lengths, each over
    terms of one sign or no larger than the result (condition number at most 1)."""
    return sum(lengths) * eps(dtype)


def assert_within_rounding(got: torch.Tensor, ref: torch.Tensor, lengths: int | tuple[int, ...],
                           scale: float | None = None, dtype: torch.dtype = torch.float32, what: str = "") -> None:
    """``got`` equals ``ref`` (float64, or the same computation in another order) up to
    ``rounding_bound(lengths, scale)``; ``scale`` defaults to the largest |ref|."""
    got, ref = got.detach().double(), ref.detach().double()
    scale = float(ref.abs().max()) if scale is None else scale
    bound = rounding_bound(lengths, scale, dtype)
    diff = float((got - ref).abs().max()) if got.numel() else 0.0
    assert diff <= bound, (f"{what}: differs by {diff:.3g}, more than the rounding bound {bound:.3g} "
                           f"(reductions {lengths} x eps {eps(dtype):.3g} x scale {scale:.3g})")


def run_rtol(cfg, steps: int = 1) -> float:
    """Relative bound on a training run's loss (and gradient norm) per step, for two runs of
    the same model and batch that differ only in summation order (mesh, fusion, kernels, CPU).

    One step's loss goes through the model's reductions — a matmul over ``d_model`` and over
    ``d_ff`` per block, attention over the sequence, the softmax over the vocabulary — and
    the mean over the global batch's tokens. Later steps start from parameters that differ
    by what AdamW made of rounding-level gradient differences; where a gradient is near
    zero AdamW can turn that into an lr-sized step, but such a parameter moves the loss
    only in proportion to its (near-zero) gradient, so each step adds one more step's
    rounding at most: hence the factor ``steps``."""
    return steps * reduction_rtol(*run_lengths(cfg))


def run_lengths(cfg) -> tuple[int, int]:
    """The reductions one training step's values go through (see ``run_rtol``): the blocks'
    (d_model, d_ff and the sequence, per layer) and the head's (d_model, the vocabulary and
    the global batch's tokens)."""
    m, t = cfg.model, cfg.train
    d_ff = getattr(m, "d_ff", 0) or 4 * m.d_model
    return m.n_layers * (m.d_model + d_ff + t.seq_len), m.d_model + m.vocab_size + t.global_batch_size * t.seq_len


def assert_runs_match(got: list[dict], want: list[dict], cfg, what: str = "") -> None:
    """Two training runs' per-step metrics (``Run.do_step``'s) agree: loss and gradient norm
    at every step within ``run_rtol(cfg, step)``. The gradient norm is what shows a wrong
    gradient scale that AdamW would hide from the losses."""
    assert len(got) == len(want), f"{what}: {len(got)} steps against {len(want)}"
    for key in ("loss", "grad_norm"):
        assert_losses_match([m[key] for m in got], [m[key] for m in want], cfg, f"{what} {key}")


def assert_losses_match(got: list[float], want: list[float], cfg, what: str = "loss", first_step: int = 1) -> None:
    """Per-step values of two training runs (from step ``first_step`` on) agree within
    ``run_rtol(cfg, step)``."""
    got, want = [float(x) for x in got], [float(y) for y in want]
    assert len(got) == len(want), f"{what}: {len(got)} steps against {len(want)}"
    for step, (x, y) in enumerate(zip(got, want), first_step):
        rtol = run_rtol(cfg, step)
        assert abs(x - y) <= rtol * abs(y), f"{what} at step {step}: {x!r} against {y!r} (rtol {rtol:.3g})"


def forward_lengths(mcfg, seq: int) -> int:
    """The reductions one forward pass of a model config goes through, for ``seq`` positions:
    per block d_model (projections), d_ff (the MLP's down projection) and the sequence
    (attention), then d_model for the head."""
    d_ff = getattr(mcfg, "d_ff", 0) or 4 * mcfg.d_model
    return mcfg.n_layers * (mcfg.d_model + d_ff + seq) + mcfg.d_model
