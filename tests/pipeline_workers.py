"""Code that runs inside the ranks of the pipeline tests (see multirank.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.utils import counters

from fxmega.config import ParallelConfig
from fxmega.core import tree
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.parity import record
from tests.sharding_workers import BUCKET, tiny_config

# tiny models with 4 blocks, so that 2 ranks x 2 virtual stages each get one
FOUR_BLOCKS = ("model.n_layers=4",)


def pipelined(runs: list[tuple[str, dict, bool, tuple]], steps: int) -> dict | None:
    """Train each (name, parallel config, compile, extra overrides) for ``steps`` steps;
    rank 0 returns each one's record (tests.parity) and validation loss."""
    out = {}
    for name, parallel, compile, extra in runs:
        model = parallel.pop("model", "tiny_gpt")
        cfg = tiny_config(compile=compile, extra=FOUR_BLOCKS + tuple(extra), model=model)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(bucket_size=BUCKET, **parallel))
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        torch._dynamo.reset()
        counters.clear()
        run = Run(cfg, par, device)
        result = record(run, steps)
        graphs = counters["stats"]["unique_graphs"]  # of the training steps
        local = {p: t.detach().clone() for p, t in tree.items(run.params)}
        out[name] = {**result, "valid": run.evaluate(), "local": local, "coords": par.groups.coords,
                     "graphs": graphs, "shared_groups": run.train_step.shared_group_sizes}
    return out if torch.distributed.get_rank() == 0 else _rank_result(out)


def _rank_result(out: dict) -> dict:
    return {name: {k: r[k] for k in ("local", "coords", "graphs", "shared_groups")} for name, r in out.items()}


class PartialLossMask:
    """A run's data with a ``loss_mask`` that keeps about two thirds of the targets, drawn
    from the step so every mesh sees the same mask: masked-out targets must leave the loss's
    sum and its count alike, on one device, across data ranks and on the last stage."""

    def __init__(self, data) -> None:
        self.data = data

    def global_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        batch = self.data.global_batch(step, batch_size)
        draw = torch.rand(batch["targets"].shape, generator=torch.Generator().manual_seed(1000 + step))
        return {**batch, "loss_mask": (draw < 0.67).float()}

    def __getattr__(self, name: str):
        return getattr(self.data, name)


def masked_run(cfg, par=None, device=None) -> Run:
    run = Run(cfg, par, device) if par is not None else Run(cfg)
    run.train_data, run.valid_data = PartialLossMask(run.train_data), PartialLossMask(run.valid_data)
    return run


def partial_loss_mask(parallel: dict, steps: int) -> dict | None:
    """The tiny GPT with a partial loss mask on a mesh, eagerly: losses, gradient norms and
    the validation loss (rank 0)."""
    cfg = dataclasses.replace(tiny_config(compile=False, extra=("train.micro_batch_size=2",)),
                              parallel=ParallelConfig(bucket_size=BUCKET, **parallel))
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = masked_run(cfg, par, device)
    out = record(run, steps)
    out["valid"] = run.evaluate()
    return out if torch.distributed.get_rank() == 0 else None
