"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout under a checkpoint root::

    root/step_00000200/    one DCP checkpoint (each rank writes its own shards)
    root/latest            text file naming the newest complete step directory

A checkpoint is written into a hidden temporary directory and renamed into place only when
complete; ``latest`` is replaced (atomically) last. A crash during a save therefore leaves
the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fxmega.errors import CheckpointError


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _single_process() -> bool:
    return not dist.is_initialized()


def save(root: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Save ``state`` (a tree of tensors, DTensors and plain values) as step ``step``."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if not _single_process():
        dist.barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, checkpoint_id=str(tmp), no_dist=_single_process())
    if not _single_process():
        dist.barrier()
    if _is_rank0():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / "latest")
    if not _single_process():
        dist.barrier()
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None if there is none yet."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    target = Path(root) / pointer.read_text().strip()
    if not (target / ".metadata").is_file():
        raise CheckpointError(f"{pointer} names {target.name}, which has no DCP .metadata file: the checkpoint is "
                              f"incomplete or was moved; point 'latest' at a complete step_* directory")
    return target


def load(path: str | Path, template: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``template`` (tensors filled in place, plain
    values replaced) and return it. Tensors in the template decide shapes and placements,
    so a checkpoint loads onto another mesh (DCP reshards)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata file)")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            with torch.no_grad():  # parameters are leaves that require grad; loading overwrites them
                dcp.load(template, checkpoint_id=str(path), no_dist=_single_process())
    except Exception as e:  # DCP raises many types; name the checkpoint and the cause
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {e}") from e
    return template
