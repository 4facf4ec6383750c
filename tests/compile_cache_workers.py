"""Code that runs inside the ranks of tests/test_compile_cache.py (see multirank.py)."""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fxmega.parallel.distributed import stable_compile_cache_keys


def _column_parallel_loss(mesh: DeviceMesh, x: torch.Tensor, w: DTensor) -> torch.Tensor:
    # the mesh enters the graph as an input when compiled code names it, as fxmega's layouts do
    return (DTensor.from_local(x, mesh, [Replicate()]) @ w).relu().sum()


def compile_on_tp(cache_base: str, stable: bool) -> dict:
    """A column-parallel matmul's forward and backward compiled with inductor on a 2-rank tp
    mesh, in this rank's own cache under ``cache_base``: the cache's hits and misses."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_base, f"rank{dist.get_rank()}")
    if stable:
        stable_compile_cache_keys()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]).requires_grad_()
    x = torch.randn(4, 8)
    loss = functools.partial(_column_parallel_loss, mesh)
    loss(x, w)  # eager first, as a run's set-up is: DTensor's dispatch hashes the mesh
    torch.compile(loss, backend="inductor", fullgraph=True)(x, w).full_tensor().backward()
    return {**counters["inductor"], **counters["aot_autograd"]}
