"""A frozen second parameter tree in a run: a reference model (DPO's) or a teacher
(distillation's), which an objective that ``reads_reference`` reads the outputs of.

It is the same model as the trained one, held as the trained parameters are: this rank's
shards under the same plan (tp splits, ZeRO-3/fsdp shards), loaded parameters-only from a
checkpoint of any mesh through the same resharding load. It is not an optimizer input, has
no gradient and is not saved: a checkpoint records the run's config, and the reference is
loaded again from its path on resume. Its outputs are computed inside the step's graph
(``fxmega.models.lm_loss_sum``), under ``torch.no_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.core import tree
from fxmega.core.errors import CheckpointError
from fxmega.parallel.runtime import Parallel
from fxmega.storage import checkpoint, run_state


@dataclass
class FrozenParams:
    """What ``run_state.load_into`` fills, parameters only (a ``run_state.HoldsParams``)."""

    parallel: Parallel | None
    specs: dict
    local_specs: dict
    params: dict


def load_reference(path: str, like: tree.Tree, specs: dict, local_specs: dict, parallel: Parallel | None) -> dict:
    """The parameters of checkpoint ``path`` (a root's latest, or a step directory) as a tree
    shaped, sharded and placed as ``like`` (this rank's trained parameters), frozen."""
    found = checkpoint.resolve(path)
    if found is None:
        raise CheckpointError(f"reference model {path}: no checkpoint there (give a checkpoint root or a step "
                              f"directory that run.py train --save wrote)")
    frozen = FrozenParams(parallel, specs, local_specs,
                          tree.map_leaves(lambda p: torch.empty_like(p.detach(), requires_grad=False), like))
    run_state.load_into(frozen, found, params_only=True)
    return frozen.params
