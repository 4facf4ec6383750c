"""Code that runs inside the ranks of the checkpoint tests (see multirank.py)."""

from __future__ import annotations

import dataclasses

import torch

from fxmega.config import ParallelConfig
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.pipeline_workers import FOUR_BLOCKS
from tests.sharding_workers import tiny_config

EXTRA = FOUR_BLOCKS + ("train.micro_batch_size=2", "train.steps=6")


def config(parallel: dict | None, model: str = "tiny_gpt"):
    cfg = tiny_config(compile=False, model=model, extra=EXTRA)
    return cfg if parallel is None else dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))


def _run(parallel: dict, model: str):
    cfg = config(parallel, model)
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    return Run(cfg, par, device)


def save_then_load(save_on: dict | None, root: str, save_at: int, load_on: dict | None = None,
                   model: str = "tiny_gpt") -> dict | None:
    """Train 6 steps of ``model`` on ``save_on``, saving at ``save_at``; then, if ``load_on``
    is given, a fresh run on that mesh loads the checkpoint and trains to step 6."""
    out = {}
    if save_on is not None:
        run = _run(save_on, model)
        out["saved_run"] = []
        for step in range(6):
            out["saved_run"].append(run.do_step()["loss"])
            if step + 1 == save_at:
                run.save(root)
    if load_on is not None:
        run = _run(load_on, model)
        assert run.resume(root) and run.step == save_at
        out["loaded_run"] = [run.do_step()["loss"] for _ in range(6 - save_at)]
    return out if torch.distributed.get_rank() == 0 else None
