"""Code that runs inside the ranks of the pipeline tests (see multirank.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.utils import counters

from fxmega import tree
from fxmega.config import ParallelConfig
from fxmega.sharding import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.train import Run
from tests.sharding_workers import BUCKET, tiny_config

# tiny models with 4 blocks, so that 2 ranks x 2 virtual stages each get one
FOUR_BLOCKS = ("model.n_layers=4",)


def pipelined(runs: list[tuple[str, dict, bool, tuple]], steps: int) -> dict | None:
    """Train each (name, parallel config, compile, extra overrides) for ``steps`` steps;
    rank 0 returns the losses, validation loss and full parameters of each."""
    out = {}
    for name, parallel, compile, extra in runs:
        model = parallel.pop("model", "tiny_gpt")
        cfg = tiny_config(compile=compile, extra=FOUR_BLOCKS + tuple(extra), model=model)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(bucket_size=BUCKET, **parallel))
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        torch._dynamo.reset()
        counters.clear()
        run = Run(cfg, par, device)
        losses = [run.do_step()["loss"] for _ in range(steps)]
        graphs = counters["stats"]["unique_graphs"]  # of the training steps
        valid = run.evaluate()
        full = {p: t.detach().clone() for p, t in tree.items(run.full_params())}
        local = {p: t.detach().clone() for p, t in tree.items(run.params)}
        out[name] = {"losses": losses, "valid": valid, "params": full, "local": local, "coords": par.coords,
                     "graphs": graphs}
    return out if torch.distributed.get_rank() == 0 else _rank_result(out)


def _rank_result(out: dict) -> dict:
    return {name: {"local": r["local"], "coords": r["coords"], "graphs": r["graphs"]} for name, r in out.items()}
