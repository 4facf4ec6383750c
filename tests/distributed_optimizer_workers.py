"""Code that runs inside the ranks of tests/test_distributed_optimizer.py (see multirank.py)."""

from __future__ import annotations

import torch

from fxmega.core import tree
from fxmega.parallel import distributed
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.parity import record
from tests.sharding_workers import AOT_EAGER, tiny_config

FLAT = dict(zero=1, distributed_optimizer=True)


def config(mesh: str, extra: tuple = (), **parallel):
    """The tiny GPT (embed 64) on ``mesh`` with the distributed optimizer, compiled with
    aot_eager (the same graph and collectives as inductor, op by op)."""
    return tiny_config(dict(mesh=mesh, **(FLAT | parallel)), extra=(*AOT_EAGER, *extra))


def _moment_numel(run: Run) -> int:
    return sum(t.numel() for t in run.opt_state["exp_avg"])


def train_and_save(cases: dict[str, tuple[str, tuple, dict]], steps: int, root: str | None = None) -> dict | None:
    """Each case ``name -> (mesh, config overrides, parallel overrides)`` trained ``steps``
    steps (tests.parity's record), with each rank's optimizer elements per moment; the
    last case saved under ``root`` when given. Rank 0 answers."""
    out = {}
    for name, (mesh, extra, parallel) in cases.items():
        cfg = config(mesh, extra, **parallel)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        torch._dynamo.reset()
        result = record(run, steps)
        numel = [0] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(numel, _moment_numel(run))
        out[name] = {**result, "moment_numel": numel, "exp_avg_sq": _full(run.full_opt_state("exp_avg_sq"))}
        if root is not None and name == list(cases)[-1]:
            run.save(root)
            run.finish_saves()
    return out if torch.distributed.get_rank() == 0 else None


def _full(t: dict) -> dict:
    return {p: v.detach().cpu().clone() for p, v in tree.items(t)}


def load(root: str, cases: dict[str, tuple[str, tuple, dict]]) -> dict | None:
    """The checkpoint under ``root`` loaded into each case's run: its full parameters and
    both moments, and one more step's loss."""
    out = {}
    for name, (mesh, extra, parallel) in cases.items():
        cfg = config(mesh, extra, **parallel)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        assert run.resume(root)
        out[name] = {"params": _full(run.full_params()), "exp_avg": _full(run.full_opt_state("exp_avg")),
                     "exp_avg_sq": _full(run.full_opt_state("exp_avg_sq")), "step": run.step}
    return out if torch.distributed.get_rank() == 0 else None
