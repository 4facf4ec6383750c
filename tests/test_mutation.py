"""The parity check can fail: a data-parallel run whose first gradient bucket is doubled
after its all-reduce (a wrong gradient scale on part of the model, the bug AdamW hides in
the parameters) must fail ``tests.parity.assert_matches_one_device``, the check every
parallel-equals-one-device test makes, while the same run unmutated passes it; and so must a
tensor-parallel run whose row-parallel partial sums are left unreduced."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial

from fxmega.parallel.activation_layouts import ActivationLayouts
from fxmega.parallel.grad_sync import GradientSync
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_gradients_match, assert_matches_one_device, record
from tests.sharding_workers import AOT_EAGER, STRATEGIES, tiny_config, train

STEPS = 3


def dp2_runs(steps: int) -> dict | None:
    """dp=2 trained twice on the same ranks: as it is, and with the first all-reduce bucket's
    gradients doubled (this process only: the class is patched before the step compiles)."""
    right = GradientSync.final_grads

    def doubled(self: GradientSync, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        reduced = right(self, grads)
        first = set(self._replica[0][3])  # tensor indices of the first all-reduce bucket
        return [g * 2 if i in first else g for i, g in enumerate(reduced)]

    cfg = tiny_config(STRATEGIES["dp2"], extra=AOT_EAGER)
    return _right_and_mutated(GradientSync, "final_grads", doubled, cfg, steps)


def _right_and_mutated(cls: type, method: str, mutated, cfg, steps: int) -> dict | None:
    """``cfg`` trained twice on these ranks, as it is ("right") and with ``cls.method``
    replaced by ``mutated`` ("mutated"; this process only, restored after): each run's
    record on rank 0."""
    out, right = {}, getattr(cls, method)
    for name, patch in (("right", right), ("mutated", mutated)):
        setattr(cls, method, patch)
        try:
            _, out[name], _ = train(cfg, steps, collectives=False)
        finally:
            setattr(cls, method, right)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.mark.slow
def test_parity_check_fails_on_a_doubled_gradient_bucket():
    cfg = tiny_config(compile=False)
    ref = record(Run(cfg), STEPS)
    got = run_ranks(2, "tests.test_mutation:dp2_runs", STEPS)[0]
    assert_matches_one_device(got["right"], ref, cfg, "dp2")
    with pytest.raises(AssertionError, match="dp2 doubled grad norm at step 1"):
        assert_matches_one_device(got["mutated"], ref, cfg, "dp2 doubled")
    # and the per-parameter gradients alone see it, naming a parameter of the first bucket
    with pytest.raises(AssertionError, match="dp2 doubled gradient of .* after step 1"):
        assert_gradients_match(got["mutated"]["first_moment"], ref["first_moment"], cfg, "dp2 doubled")
    assert_gradients_match(got["right"]["first_moment"], ref["first_moment"], cfg, "dp2")


def tp2_runs(steps: int) -> dict | None:
    """tp=2 trained twice on the same ranks: as it is, and with the row-parallel partial sums
    left unreduced (each rank goes on with its own half of the attention and MLP outputs:
    the all-reduce Megatron's row-parallel layers need, dropped)."""
    right = ActivationLayouts.constrain

    def dropped(self: ActivationLayouts, x: torch.Tensor, axes) -> torch.Tensor:
        # plain Partial: the row-parallel outputs (the embedding's masked partial keeps its reduction)
        if isinstance(x, DTensor) and any(type(p) is Partial for p in x.placements):
            return DTensor.from_local(x.to_local(), self.mesh, self.placement(axes), run_check=False)
        return right(self, x, axes)

    # eagerly: dynamo does not trace the patched layout function
    cfg = tiny_config(STRATEGIES["tp2"], compile=False)
    return _right_and_mutated(ActivationLayouts, "constrain", dropped, cfg, steps)


@pytest.mark.slow
def test_parity_check_fails_on_a_dropped_tensor_parallel_partial_sum():
    cfg = tiny_config(compile=False)
    ref = record(Run(cfg), STEPS)
    got = run_ranks(2, "tests.test_mutation:tp2_runs", STEPS)[0]
    assert_matches_one_device(got["right"], ref, cfg, "tp2")
    with pytest.raises(AssertionError, match="tp2 dropped loss at step 1"):
        assert_matches_one_device(got["mutated"], ref, cfg, "tp2 dropped")
