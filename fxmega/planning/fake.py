"""Any mesh in one process: torch's fake process group and meta tensors.

``fake_world(world_size, rank)`` makes this process rank ``rank`` of a world that does not
exist: collectives return at once without moving data, and tensors on the ``meta`` device
have shapes but no storage. On top of it fxmega builds the same DeviceMesh, ``Parallel``
and DTensors a real run builds, so the plan for 8x4x2 (64 ranks) or 1,024 ranks is
checked, and one rank's whole training step traced, on a laptop:

    with fake_world(64, rank=5):
        par = fake_parallel(cfg)           # this rank's Parallel on the fake mesh
        params = meta_params(par)          # its shards, as meta DTensors' local tensors
        graphs = trace_rank_step(cfg, par) # the compiled step's collectives (aot_eager)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxmega.compiler.inspect import Collective, record_collectives
from fxmega.config import RunConfig
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.core.precision import compute_dtype
from fxmega.models import loss_by_pieces, model_for
from fxmega.models.weight_uses import fp8_gathered
from fxmega.ops import fp8, matmul
from fxmega.optim.optimizer import Optimizer, ParamRole, optimizer_for
from fxmega.parallel.distributed import checked_plan, rank_parallel
from fxmega.parallel.runtime import Parallel
from fxmega.sharding.mesh import MeshSpec, build_device_mesh
from fxmega.training.optim import param_roles
from fxmega.training.pipeline_step import PipelineStep
from fxmega.training.step import TrainStep


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake ``world_size``-rank process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank}: the mesh has ranks 0..{world_size - 1}")
    if dist.is_initialized():
        raise ConfigError("a process group already exists in this process; plan in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_parallel(cfg: RunConfig, rank: int) -> Parallel:
    """This rank's ``Parallel`` on the fake process group (as ``distributed.setup`` builds it
    in a real run, without printing)."""
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    model = model_for(cfg.model)
    plan = checked_plan(cfg, mesh, model)
    return rank_parallel(cfg, plan, build_device_mesh(mesh, "cpu"), rank, model)


def meta_params(par: Parallel) -> tree.Tree:
    """This rank's parameter shards as meta tensors (shapes only), ready for a step."""
    return tree.map_with_path(
        lambda path, _: torch.empty(par.plan.params[path].local_shape("param"), device="meta", requires_grad=True),
        par.specs)


def check_placements(par: Parallel) -> int:
    """Wrap every local shard as a DTensor over the whole (fake) mesh and check that its
    global shape and local shape are the plan's; returns how many were checked."""
    n = 0
    for path, _ in tree.items(par.specs):
        lay = par.plan.params[path]
        for kind in ("param", "grad", "opt"):
            dt = par.shards.as_dtensor(torch.empty(lay.local_shape(kind), device="meta"), lay, kind)
            if tuple(dt.shape) != lay.shape or tuple(dt.to_local().shape) != lay.local_shape(kind):
                raise AssertionError(f"{path} ({kind}): DTensor {tuple(dt.shape)} local {tuple(dt.to_local().shape)}"
                                     f" vs plan {lay.shape} local {lay.local_shape(kind)}")
            n += 1
    return n


@dataclass
class RankTrace:
    graphs: list[list[Collective]]  # per compiled graph, its collectives in order
    labels: dict[str, str]  # process-group name -> mesh axes
    seconds: float

    def by_axis(self) -> dict[str, dict[str, tuple[int, float]]]:
        """axis -> op -> (count, bytes of the inputs)."""
        out: dict[str, dict[str, tuple[int, float]]] = {}
        for graph in self.graphs:
            for c in graph:
                axis = self.labels.get(c.group, c.group)
                n, b = out.setdefault(axis, {}).get(c.op, (0, 0.0))
                out[axis][c.op] = (n + 1, b + c.bytes)
        return out

    def overlap_by_axis(self) -> dict[str, dict[str, tuple[int, float]]]:
        """axis -> op -> (how many have no compute between their start and their wait, the
        FLOPs that are between, summed): what each collective can hide behind, in the order
        the graphs were traced."""
        out: dict[str, dict[str, tuple[int, float]]] = {}
        for graph in self.graphs:
            for c in graph:
                axis = self.labels.get(c.group, c.group)
                n, f = out.setdefault(axis, {}).get(c.op, (0, 0.0))
                out[axis][c.op] = (n + (c.ops_between == 0), f + c.flops_between)
        return out


def trace_rank_step(cfg: RunConfig, par: Parallel) -> RankTrace:
    """Compile this rank's training step on meta tensors with the aot_eager backend (the
    forward, backward and update graphs, collectives included; no kernels are generated)
    and return the collectives each graph holds, each compiled graph once (a step of n
    micro batches runs the accumulation graph n - 1 times). With pp, the rank's stages are
    traced for one micro batch each, forward and backward; the schedule's sends and the
    update are not in the trace."""

    start = time.perf_counter()
    if cfg.compute.fp8_gather:  # as ``Run`` sets it: the weights the fp8 recipe's matmuls cast
        par.gather_in_fp8(fp8_gathered(cfg.model, par.plan.tp_shapes()))
    params = meta_params(par)
    optimizer = optimizer_for(cfg.optim)
    opt = par.init_opt_state(optimizer, "meta")
    t = cfg.train
    roles = par.optimizer_roles(param_roles(par.specs, cfg.optim.decay_embeddings), optimizer)
    batch = {"inputs": torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long, device="meta"),
             "targets": torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long, device="meta")}
    batch = par.local_batch(batch)  # under cp: this rank's chunks and their positions
    with record_collectives() as graphs, matmul.use(fp8.recipe_for(cfg.compute.fp8, torch.device("meta"))):
        if par.plan.pipeline is None:
            loss_sum = par.loss_sum_fn(loss_by_pieces(cfg.model, par.compute))
            step = TrainStep(loss_sum, roles, optimizer, cfg.optim.clip_grad, compile=True, parallel=par,
                             backend="aot_eager")
            step(params, opt, [batch], 1e-4, n_tokens=torch.tensor(float(batch["targets"].numel())))
        else:
            _trace_stages(cfg, par, params, roles, optimizer, batch)
    return RankTrace(graphs, par.groups.labels(), time.perf_counter() - start)


def _trace_stages(cfg: RunConfig, par: Parallel, params: tree.Tree, roles: list[ParamRole], optimizer: Optimizer,
                  batch: dict) -> None:
    params = tree.map_leaves(lambda p: torch.nn.Parameter(p.detach(), requires_grad=True), params)
    n_micro = max(cfg.grad_accum_steps(par.groups.data_size), par.plan.pipeline.pp)
    model = model_for(cfg.model)
    step = PipelineStep(par, cfg.model, model, model.objective(cfg.model), params, roles, optimizer,
                        cfg.optim.clip_grad, n_micro, True, torch.device("meta"), backend="aot_eager")
    first_batch = {**batch, **{k: batch["inputs"] for k in model.EMBED_INPUTS}}  # e.g. BERT's token types
    for stage in step.stages:  # a later stage reads the residual stream in the compute dtype
        first = stage.stage_index == 0
        x = first_batch["inputs"] if first else torch.zeros(
            (*batch["inputs"].shape, cfg.model.d_model), dtype=compute_dtype(cfg.compute.precision), device="meta",
            requires_grad=True)
        out = stage.submod(x, **step.stage_kwargs([first_batch]))
        ps = [p for p in stage.submod.parameters()]
        torch.autograd.grad(out.float().sum(), ps + ([] if first else [x]), allow_unused=True)
