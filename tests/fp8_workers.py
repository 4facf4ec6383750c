"""Code that runs inside the ranks of tests/test_fp8_mesh.py (see multirank.py)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fxmega.ops import fp8, matmul
from tests.sharding_workers import AOT_EAGER, tiny_config, train


def fp8_config(recipe: str, parallel: dict | None, extra: tuple = ()):
    """The tiny GPT (its dense weights all multiples of 16, so every ``linear`` matmul runs in
    fp8) with ``compute.fp8=recipe``, compiled with aot_eager."""
    return tiny_config(parallel, extra=(*AOT_EAGER, f"compute.fp8={recipe}", *extra))


def train_cases(cases: dict[str, tuple], steps: int) -> dict | None:
    """Each case ``name -> (recipe, parallel config[, config overrides])`` trained ``steps``
    steps (tests.parity's record, with the bytes the step's all-gathers send per rank under
    ``"gathered_bytes"``). Rank 0 answers."""
    out = {}
    for name, (recipe, parallel, *extra) in cases.items():
        _, result, graphs = train(fp8_config(recipe, parallel, *extra), steps, collectives=True)
        result["gathered_bytes"] = sum(sent for g in graphs for op, _, _, sent in g if "all_gather" in op)
        out[name] = result
    return out if torch.distributed.get_rank() == 0 else None


def tp_matmuls(name: str, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor) -> dict | None:
    """``x @ w`` under fp8 recipe ``name`` on DTensors over a 2-rank tp mesh, split as
    Megatron's column-parallel (x replicated, w's output columns split) and row-parallel
    (x's and w's reduced dim split) layers split them, with ``go`` as the output's gradient:
    rank 0 answers with the full output and gradients of each."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    with matmul.use(fp8.recipe(name, emulate=True)):
        splits = {"column": (Replicate(), Shard(1)), "row": (Shard(x.dim() - 1), Shard(0))}
        for kind, (x_split, w_split) in splits.items():
            xd = distribute_tensor(x, mesh, [x_split]).requires_grad_()
            wd = distribute_tensor(w, mesh, [w_split]).requires_grad_()
            y = matmul.matmul(xd, wd).full_tensor()
            y.backward(go)
            out[kind] = {"out": y.detach(), "grad_x": xd.grad.full_tensor(), "grad_w": wd.grad.full_tensor()}
    return out if torch.distributed.get_rank() == 0 else None
