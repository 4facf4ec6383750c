"""The check every parallel-equals-one-device test makes, in one place, so that the mutation
test (tests/test_mutation.py) proves that this very check fails on a wrong gradient."""

from __future__ import annotations

import torch

from tests.tolerance import assert_losses_match


def unpad(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor tp padded (a vocabulary) cut back to the one-device shape."""
    return full[tuple(slice(0, n) for n in like.shape)]


def assert_matches_one_device(got: dict, ref_metrics: list[dict], ref_params: dict, cfg, name: str) -> None:
    """``got`` (losses, grad_norms, full params of a parallel run) against the one-device
    run: losses and gradient norms at every step, and the parameters after the last."""
    # the mesh sums in other orders; the gradient norm shows a wrong gradient scale AdamW hides
    assert_losses_match(got["losses"], [m["loss"] for m in ref_metrics], cfg, f"{name} loss")
    assert_losses_match(got["grad_norms"], [m["grad_norm"] for m in ref_metrics], cfg, f"{name} grad norm")
    for path, ref in ref_params.items():
        # not a rounding bound: AdamW turns rounding-level differences of near-zero gradients
        # into steps of up to lr (3e-3), and 5 fp32 steps sit ~1.5e-4 from the same run in
        # float64; the loss and the gradient norm above are the tight checks
        torch.testing.assert_close(unpad(got["params"][path], ref), ref, rtol=0, atol=5e-4, msg=path)
