"""The parity check can fail: a data-parallel run whose first gradient bucket is doubled
after its all-reduce (a wrong gradient scale on part of the model, the bug AdamW hides in
the parameters) must fail ``tests.parity.assert_matches_one_device``, the check every
parallel-equals-one-device test makes, while the same run unmutated passes it."""

from __future__ import annotations

import pytest
import torch

from fxmega.core import tree
from fxmega.sharding.grad_sync import GradientSync
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device
from tests.sharding_workers import AOT_EAGER, STRATEGIES, _train, tiny_config

STEPS = 3


def dp2_runs(steps: int) -> dict | None:
    """dp=2 trained twice on the same ranks: as it is, and with the first all-reduce bucket's
    gradients doubled (this process only: the class is patched before the step compiles)."""
    out = {}
    right = GradientSync.final_grads

    def doubled(self: GradientSync, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        reduced = right(self, grads)
        first = set(self._replica[0][3])  # tensor indices of the first all-reduce bucket
        return [g * 2 if i in first else g for i, g in enumerate(reduced)]

    for name, patch in (("right", right), ("doubled", doubled)):
        GradientSync.final_grads = patch
        try:
            run, _, metrics, _ = _train(tiny_config(STRATEGIES["dp2"], extra=AOT_EAGER), steps, record=False)
        finally:
            GradientSync.final_grads = right
        out[name] = {"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
                     "params": {p: t.detach().clone() for p, t in tree.items(run.full_params())}}
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.slow
def test_parity_check_fails_on_a_doubled_gradient_bucket():
    one = Run(tiny_config(compile=False))
    ref = [one.do_step() for _ in range(STEPS)]
    ref_params = {p: t.detach() for p, t in tree.items(one.params)}
    got = run_ranks(2, "tests.test_mutation:dp2_runs", STEPS)[0]
    assert_matches_one_device(got["right"], ref, ref_params, one.cfg, "dp2")
    with pytest.raises(AssertionError, match="dp2 doubled grad norm at step 1"):
        assert_matches_one_device(got["doubled"], ref, ref_params, one.cfg, "dp2 doubled")
