"""Code that runs inside the ranks of tests/test_overlap.py (see multirank.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch._inductor.utils import run_and_get_code

from fxmega.compiler.generated_code import gathers_ahead, kernels_before_waits
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.parity import record
from tests.sharding_workers import tiny_config


def with_and_without(steps: int, parallel: dict) -> dict | None:
    """The tiny GPT on ``parallel`` compiled with inductor, overlap off and on: per collective
    of the step's generated code, the kernels between its start and its wait, and the losses."""
    out = {}
    for on in (False, True):
        cfg = tiny_config(parallel)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_comm=on))
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        torch._dynamo.reset()
        first, codes = run_and_get_code(run.do_step)
        losses = [first["loss"]] + [run.do_step()["loss"] for _ in range(steps - 1)]
        out[on] = {"hidden": [kernels_before_waits(code) for code in codes],
                   "ahead": [gathers_ahead(code) for code in codes], "losses": losses}
    return out if torch.distributed.get_rank() == 0 else None


PARAM_GATHER = dict(mesh="dp=2", zero=1, distributed_optimizer=True, overlap_comm=True, overlap_param_gather=True)
TWO_MICRO = ("train.micro_batch_size=2",)  # 2 micro batches per rank: the gather is in the first one's graph


def param_gather(steps: int) -> dict | None:
    """The distributed optimizer with ``overlap_param_gather``, compiled with inductor: the
    run's record (tests.parity; ``full_params`` reads whole parameters) and, per compiled
    graph, the kernels before each collective's wait."""
    cfg = tiny_config(PARAM_GATHER, extra=TWO_MICRO)
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    torch._dynamo.reset()
    result, codes = run_and_get_code(record, run, steps)
    out = {**result, "hidden": [kernels_before_waits(c) for c in codes], "ahead": [gathers_ahead(c) for c in codes],
           "buckets": len(par.grads.flat.buckets)}
    return out if torch.distributed.get_rank() == 0 else None

