"""Process groups: join the one a launcher set up, or start local processes with
torch.distributed's own elastic launcher. fxmega never spawns or connects ranks itself.

Under ``torchrun`` (or Slurm/Kubernetes through torchrun) the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) is used as it is; NCCL on CUDA, gloo on
CPU. ``python run.py --mesh 2x2`` without a launcher runs the same command line under torch's
launcher (``torchrun --standalone --nproc-per-node 4``) after every check: ``fxmega.cli.launch``.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fxmega.config import RunConfig
from fxmega.core.device import kernel_cache_name
from fxmega.core.log import get_logger
from fxmega.models import model_for
from fxmega.models.family import ModelFamily
from fxmega.optim.optimizer import optimizer_for
from fxmega.parallel.context import check_context_parallel
from fxmega.parallel.runtime import Parallel
from fxmega.parallel.strategy import run_plan
from fxmega.sharding.mesh import MeshSpec, build_device_mesh, check_world_size
from fxmega.sharding.plan import ShardingPlan

log = get_logger(__name__)


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def per_rank_caches() -> None:
    """Give each rank its own inductor cache: ranks sharing one load each other's compiled
    graphs, which name process groups by number, and then hang."""
    rank = os.environ.get("RANK")
    if rank is None:
        return
    base = os.environ.get("FXMEGA_INDUCTOR_CACHE_BASE") or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or \
        os.path.join("/tmp", f"torchinductor_{os.environ.get('USER', 'user')}")
    os.environ["FXMEGA_INDUCTOR_CACHE_BASE"] = base
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, kernel_cache_name(), f"rank{rank}")


_device_mesh_state = DeviceMesh.__getstate__


def _mesh_state_without_cached_hash(mesh: DeviceMesh) -> dict:
    state = _device_mesh_state(mesh)
    state["_hash"] = None  # recomputed on first use after unpickling
    return state


def stable_compile_cache_keys() -> None:
    """Let a graph compiled on a mesh be found again by the next process that compiles it.

    Graphs of DTensor code take the ``DeviceMesh`` as an input, and AOTAutograd's and
    inductor's caches key a graph by pickling its inputs. torch 2.13's mesh pickle holds the
    mesh's cached ``hash()``, a tuple hash that differs in every process (strings under hash
    randomisation, ``None`` by address on Python 3.11), so every run on a mesh missed the cache
    and compiled its step again: a resumed run, an evaluation, a generation after training.
    Measured on the tiny GPT at tp=2 with sequence parallelism: the first step of a second run
    took 28 s without this, 9 s with it (the whole run 44 s, 18 s). The hash is left out of the
    pickle; nothing else in it varies between processes."""
    DeviceMesh.__getstate__ = _mesh_state_without_cached_hash


def init(mesh: MeshSpec, timeout_s: int, device_type: str | None = None):
    """Join the launcher's process group and build the device mesh; returns
    ``(device_mesh, rank, device)``."""
    stable_compile_cache_keys()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt == "0":
            dist.init_process_group(backend, timeout=timeout)
        else:
            # a restarted group meets in the same store as the attempt that died; without a
            # fresh key prefix its ranks can read the dead attempt's addresses and wait forever
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(backend, store=dist.PrefixStore(f"fxmega/attempt{attempt}", store), rank=rank,
                                    world_size=world, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world_size(mesh, world, " ".join(["run.py", *sys.argv[1:]]))
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return build_device_mesh(mesh, device_type), rank, device


def checked_plan(cfg: RunConfig, mesh: MeshSpec, model: ModelFamily) -> ShardingPlan:
    """The plan for ``mesh``, after the refusals the model family makes of it (experts not
    split over tp, context parallelism it cannot run): every check of the mesh against the
    model, divisibility and stage counts included, made before a process group exists."""
    model.check_mesh(cfg.model, mesh)
    check_context_parallel(cfg, mesh, model)
    return run_plan(cfg, model)


def rank_parallel(cfg: RunConfig, plan: ShardingPlan, device_mesh: DeviceMesh, rank: int,
                  model: ModelFamily) -> Parallel:
    """Rank ``rank``'s ``Parallel`` for ``plan`` on ``device_mesh`` (a real or a fake process
    group: ``setup`` and ``fxmega.planning.fake`` build it the same way)."""
    local = local_specs(model.param_specs(cfg.model), plan, plan.mesh.coords(rank)["pp"])
    return Parallel(plan, device_mesh, rank, local, cfg.parallel.bucket_size, cfg.parallel.zero3_regather,
                    cfg.compute, cfg.parallel.cp_attention, optimizer_for(cfg.optim).whole_matrices)


def setup(cfg: RunConfig, mesh: MeshSpec, model: ModelFamily | None = None) -> tuple[Parallel, torch.device]:
    """This rank's ``Parallel`` for a run: process group, device mesh, plan. Prints the
    resolved mesh (rank 0) and every rank's coordinates. ``model``: the family whose
    parameters are planned and whose pieces pipeline stages are cut from (default: the
    config's; fine-tuning gives its classifier)."""

    model = model_for(cfg.model) if model is None else model
    plan = checked_plan(cfg, mesh, model)
    per_rank_caches()
    device_type = None if cfg.train.device == "auto" else cfg.train.device
    device_mesh, rank, device = init(mesh, cfg.parallel.timeout_s, device_type)
    if rank == 0:
        log.info(f"mesh: {mesh.describe()}, {plan.strategy.name} (zero {plan.zero})"
                 + (", sequence parallel" if plan.sequence_parallel else "")
                 + "".join(f"\nnote: {n}" for n in plan.notes))
        if plan.pipeline is not None:
            log.info("\n".join(plan.pipeline.describe()))
    coords = mesh.coords(rank)
    log.debug(f"rank {rank}: " + ", ".join(f"{a}={coords[a]}" for a in mesh.names) + f" on {device}")
    return rank_parallel(cfg, plan, device_mesh, rank, model), device


def local_specs(specs: dict, plan: ShardingPlan, pp_rank: int) -> dict:
    """The part of the spec tree pp rank ``pp_rank`` holds; blocks keep their global index
    as a dict key, so every path (and so every seed and checkpoint key) is the global one."""
    if plan.pipeline is None:
        return specs
    out: dict = {}
    for key, sub in specs.items():
        if key == "blocks":
            out["blocks"] = {str(i): b for i, b in enumerate(sub) if pp_rank in plan.pp_owners(f"blocks.{i}")}
        elif pp_rank in plan.pp_owners(key):
            out[key] = sub
    return out


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
