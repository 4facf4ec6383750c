"""The check every parallel-equals-one-device test makes, in one place, so that the mutation
test (tests/test_mutation.py) proves that this very check fails on a wrong gradient.

A run is recorded the same way on one device and on a mesh (``record``): per-step losses and
gradient norms, the parameters after the last step, and every parameter's gradient after
the first. The gradient is read from AdamW's first moment: after one step ``exp_avg`` is
``(1 - beta1)`` times the clipped global gradient, gathered like the parameters, so the
check sees the gradient the compiled step itself computed, with no second backward."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from fxmega.core import tree
from tests.tolerance import assert_losses_match, rounding_bound, run_lengths


class Recordable(Protocol):  # what record() reads: fxmega.training.run.Run
    def do_step(self) -> dict: ...
    def full_params(self) -> dict: ...
    def full_opt_state(self, name: str) -> dict: ...


def record(run: Recordable, steps: int) -> dict:
    """Train ``steps`` steps; losses, gradient norms, the full parameters after the last step
    and the full first moment after the first (every rank takes part; CPU copies)."""
    metrics, first_moment = [], None  # the first moment is read after step 1
    for step in range(steps):
        metrics.append(run.do_step())
        if step == 0:
            first_moment = {p: t.detach().cpu().clone() for p, t in tree.items(run.full_opt_state("exp_avg"))}
    return {"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
            "router": [{k: v for k, v in m.items() if k.startswith("moe_")} for m in metrics],  # MoE statistics
            "mtp": [{k: v for k, v in m.items() if k.startswith("mtp_loss_")} for m in metrics],  # MTP's depth losses
            "params": {p: t.detach().cpu().clone() for p, t in tree.items(run.full_params())},
            "first_moment": first_moment}


def unpad(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor tp padded (a vocabulary) cut back to the one-device shape."""
    return full[tuple(slice(0, n) for n in like.shape)]


def assert_gradients_match(got: dict, ref: dict, cfg, name: str) -> None:
    """Every parameter's first-step gradient (as ``exp_avg``) against the one-device run's.
    Each entry goes through the step's reductions (``run_lengths``); the global norm of the
    gradient bounds every entry, and is taken as the scale of the terms summed."""
    scale = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ref.values()))
    bound = rounding_bound(run_lengths(cfg), scale)
    for path, want in ref.items():
        diff = float((unpad(got[path], want).double() - want.double()).abs().max())
        assert diff <= bound, (f"{name} gradient of {path} after step 1: differs by {diff:.3g}, more than the "
                               f"rounding bound {bound:.3g} (reductions {run_lengths(cfg)} x eps x norm {scale:.3g})")


def assert_matches_one_device(got: dict, ref: dict, cfg, name: str) -> None:
    """``got`` (a parallel run's ``record``) against the one-device run's ``ref``: losses and
    gradient norms at every step, every parameter's gradient after the first step, and the
    parameters after the last."""
    # the mesh sums in other orders; the gradient norm shows a wrong gradient scale AdamW hides
    assert_losses_match(got["losses"], ref["losses"], cfg, f"{name} loss")
    assert_losses_match(got["grad_norms"], ref["grad_norms"], cfg, f"{name} grad norm")
    assert_gradients_match(got["first_moment"], ref["first_moment"], cfg, name)
    for path, want in ref["params"].items():
        # not a rounding bound: AdamW turns rounding-level differences of near-zero gradients
        # into steps of up to lr (3e-3), and 5 fp32 steps sit ~1.5e-4 from the same run in
        # float64; the loss, the gradient norm and the gradients above are the tight checks
        torch.testing.assert_close(unpad(got["params"][path], want), want, rtol=0, atol=5e-4, msg=path)
