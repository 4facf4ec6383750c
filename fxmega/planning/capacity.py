"""Whether this machine can hold a mesh's local ranks, asked before any rank starts.

A mesh that does not fit is refused in one line instead of being started: on a GPU machine
each rank needs a GPU of its own; on CPU each rank is a process that holds torch, gloo and
the compiler besides the plan's parameters, optimizer state and activations, and a launch
beyond the machine's memory is ended by the kernel's OOM killer, taking other work with it
(``--mesh 3x5x7`` started 105 processes on a 24 GiB machine before this check existed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fxmega.core.errors import ConfigError
from fxmega.sharding.mesh import MeshSpec

# measured: a tiny GPT rank's peak resident memory on CPU with torch, gloo and inductor's
# compilation (0.63 GiB, --mesh dp=2 --rules zero3, torch 2.13); the plan's bytes come on top
RANK_PROCESS_BYTES = 640 * 2**20
# measured: 8 ranks on 2 cores run the suite's 2x2x2 meshes; past that a rank's collectives
# wait for CPU time its peers cannot get, and the process-group timeout ends the run
RANKS_PER_CORE = 4
GiB = 2**30


@dataclass(frozen=True)
class Machine:
    """What this machine offers local ranks."""

    cores: int
    available_bytes: int  # memory the kernel can give without swapping (MemAvailable)
    gpus: int

    @staticmethod
    def this() -> Machine:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return Machine(cores, _available_bytes(), torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_capacity(mesh: MeshSpec, written: str, device_type: str, plan_bytes: int, machine: Machine) -> None:
    """Refuse a launch of ``mesh.world_size`` local ranks that ``machine`` cannot hold:
    more ranks than GPUs (``device_type`` cuda), or on CPU more than ``RANKS_PER_CORE`` per
    core or more than fit in the available memory at ``RANK_PROCESS_BYTES`` plus the plan's
    ``plan_bytes`` each. ``written``: the mesh as the user wrote it, for the advice."""
    world = mesh.world_size
    elsewhere = (f"run `run.py plan --mesh {written}` to check its plan in one process, or launch "
                 f"on several machines with torchrun (torchrun --nnodes N --nproc-per-node M run.py ..., or srun "
                 f"torchrun ... under Slurm); --oversubscribe starts them here anyway")
    if device_type == "cuda":
        if world > machine.gpus:
            raise ConfigError(f"mesh {mesh.describe()} needs {world} GPUs, one per rank, and this machine has "
                              f"{machine.gpus}: choose a mesh of at most {machine.gpus} ranks, or {elsewhere}")
        return
    per_rank = RANK_PROCESS_BYTES + plan_bytes
    fit = min(RANKS_PER_CORE * machine.cores, machine.available_bytes // per_rank)
    if world > fit:
        raise ConfigError(
            f"mesh {mesh.describe()} would start {world} local processes; this machine has {machine.cores} cores and "
            f"{machine.available_bytes / GiB:.1f} GiB available, room for {fit} ranks of this run (at most "
            f"{RANKS_PER_CORE} per core, each about {per_rank / GiB:.2f} GiB: {RANK_PROCESS_BYTES / GiB:.2f} for the "
            f"process and the compiler, {plan_bytes / GiB:.2f} for what the plan puts on a rank): choose a smaller "
            f"mesh, or {elsewhere}")
