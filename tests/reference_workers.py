"""An objective that reads a frozen reference model, and the code that runs it inside the
ranks of tests/test_reference_model.py (see multirank.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.core import tree
from fxmega.ops.objectives import REFERENCE_OUTPUTS, Batch, count
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.parity import record
from tests.sharding_workers import AOT_EAGER, STRATEGIES, tiny_config


@dataclass(frozen=True)
class LogitPull:
    """Half the squared distance of the logits to the reference model's, summed over the
    vocabulary at every counted position: zero where the two models agree. Written with
    plain tensor ops, so that under tp the vocabulary sum is DTensor's partial sum."""

    name: str = "logit-pull"
    batch_keys: tuple[str, ...] = ("targets", "loss_mask")
    sum_shape: tuple[int, ...] = ()
    reads_reference: bool = True

    def __call__(self, outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        per_position = (outputs.float() - batch[REFERENCE_OUTPUTS].float()).pow(2).sum(-1)
        mask = batch.get("loss_mask")
        if mask is not None:
            per_position = per_position * mask
        return 0.5 * per_position.sum(), count(batch)


def on_meshes(names: list[str], reference: str, steps: int) -> dict | None:
    """Each strategy trained ``steps`` steps on LogitPull toward ``reference``; rank 0
    returns each run's record (tests.parity) and whether the reference stayed as loaded."""
    out = {}
    for name in names:
        cfg = tiny_config(STRATEGIES[name], extra=AOT_EAGER)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device, objective=LogitPull(), reference=reference)
        before = [t.clone() for t in tree.leaves(run.reference)]
        out[name] = record(run, steps) | {
            "reference_unchanged": all(torch.equal(a, b) for a, b in zip(before, tree.leaves(run.reference)))}
    return out if torch.distributed.get_rank() == 0 else None

