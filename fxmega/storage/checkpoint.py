"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, optionally asynchronous,
atomic, verified on load, loadable onto another mesh.

Layout under a checkpoint root::

    root/step_00000200/    one checkpoint
        .metadata          DCP's index of every tensor's shards
        __R_I.distcp       tensor data; rank R writes only its own shards
        meta.json          step, data position, config, tokenizer, RNG: all that is not a tensor
        vocab.json, ...    the tokenizer's files, copied (``files``), so the checkpoint
                           describes itself: ``run.py generate --load`` needs nothing else
        manifest.json      size and CRC-32 of every file above, written last
    root/latest            text file naming the newest complete step directory

A save writes into ``root/.tmp_step_...`` and is renamed into place only when every rank's
files and the manifest are on disk; ``latest`` is replaced (atomically) after that, and old
checkpoints beyond ``keep_last`` are removed only then. A crash or kill at any moment
therefore leaves the previous checkpoint and pointer intact. With ``async_save`` the
tensors are copied to CPU memory and written by a background thread while training
continues; the rename happens at the next save or at the end (``Checkpointer.wait``).

This module assumes what Megatron-LM assumes: all ranks see one shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fxmega.core.errors import CheckpointError
from fxmega.core.log import get_logger
from fxmega.storage.checkpoint_files import MANIFEST, META, SafeReader, digests, read_meta, verify, write_manifest

log = get_logger(__name__)


STEP_PREFIX = "step_"
# DCP says this for every single-process save, from the writer thread too when async
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def _distributed() -> bool:
    return dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class Checkpointer:
    """Saves under one root; ``keep_last`` > 0 keeps only the newest K checkpoints."""

    def __init__(self, root: str | Path, keep_last: int = 0, async_save: bool = False) -> None:
        self.root, self.keep_last, self.async_save = Path(root), keep_last, async_save
        self._pending: tuple[Future, Path, int, dict, dict] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fxmega-checkpoint") if async_save else None
        self.blocked_s = 0.0  # time the caller waited on saves (for the benchmark and the log)

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
             files: dict[str, Path] | None = None) -> Path:
        """Start (async) or complete (sync) checkpoint ``step``; returns its final path.
        ``files`` (name in the checkpoint -> a file now) are copied in by rank 0."""
        files = files or {}
        for name in files:  # flat names beside DCP's own files, never one of them
            if Path(name).name != name or name in (META, MANIFEST, ".metadata") or name.startswith(("__", ".")):
                raise CheckpointError(f"cannot store {name!r} in a checkpoint: use a plain file name that is not "
                                      f"{META}, {MANIFEST}, .metadata or DCP's __R_I.distcp")
        t0 = time.perf_counter()
        self.wait()
        final = step_dir(self.root, step)
        tmp = self.root / f".tmp_{final.name}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        writer = dcp.FileSystemWriter(str(tmp))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.async_save:
                written = _as_future(dcp.async_save(tensors, storage_writer=writer, no_dist=not _distributed()))
                rank = _rank()
                # the CRCs of this rank's files are computed in the background too
                summed = self._pool.submit(lambda: (written.result(), _my_digests(tmp, rank))[1])
                self._pending = (summed, tmp, step, meta, files)
            else:
                try:
                    dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
                except (Exception, CheckpointException) as e:  # a full disk, a lost mount, ...
                    raise CheckpointError(f"saving step {step} into {tmp} failed ({type(e).__name__}: "
                                          f"{_first_line(e)}); the previous checkpoint and 'latest' are "
                                          f"untouched") from e
                self._finish(tmp, step, meta, files)
        self.blocked_s += time.perf_counter() - t0
        return final

    def wait(self) -> Path | None:
        """Finish the pending asynchronous save (every rank must call); its path."""
        if self._pending is None:
            return None
        t0 = time.perf_counter()
        future, tmp, step, meta, files = self._pending
        self._pending = None
        self._finish(tmp, step, meta, files, future.result())
        self.blocked_s += time.perf_counter() - t0
        return step_dir(self.root, step)

    def _finish(self, tmp: Path, step: int, meta: dict[str, Any], extra: dict[str, Path],
                files: dict | None = None) -> None:
        files = _my_digests(tmp, _rank()) if files is None else files
        if _distributed():
            everyone: list[dict] = [None] * _world()  # type: ignore[list-item]
            dist.all_gather_object(everyone, files)
            files = {k: v for part in everyone for k, v in part.items()}
        if _rank() == 0:
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            for name, source in extra.items():
                shutil.copyfile(source, tmp / name)
            files |= digests(tmp, [".metadata", META, *extra])
            write_manifest(tmp, files)
            _test_pause(step)
            final = step_dir(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = self.root / ".latest.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / "latest")
            self._retire()
            self._remove_stale()
            # said when committed: an asynchronous save is only a .tmp_ directory until here
            log.info(f"step {step}: saved checkpoint {final}")
        _barrier()

    def _remove_stale(self) -> None:
        """Half-written saves an earlier run left (killed, or stopped by a second Ctrl-C, before
        its rename): each is as large as a checkpoint. Called once a save has committed, when
        no other save of this root is in progress."""
        stale = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(f".tmp_{STEP_PREFIX}"))
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        if stale:
            log.info(f"removed {len(stale)} half-written save(s) an earlier run left in {self.root}: "
                     f"{', '.join(p.name for p in stale)}")

    def _retire(self) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))
        for old in steps[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    # DCP's messages carry whole per-rank tracebacks; the last line says what happened
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return lines[-1][:400] if lines else type(e).__name__


def _my_digests(tmp: Path, rank: int) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files rank ``rank`` wrote."""
    return digests(tmp, sorted(p.name for p in tmp.glob(f"__{rank}_*")))


def _as_future(result: Any) -> Future:
    # torch returns a Future, or an AsyncSaveResponse holding one
    return getattr(result, "upload_completion", result)


def _test_pause(step: int) -> None:
    """A test seam: ``FXMEGA_TEST_PAUSE_BEFORE_RENAME=STEP:SECONDS`` holds the save of that
    step open, files written but not renamed, so that a test can kill the process in the
    middle of saving (tests/test_checkpoint.py)."""
    at, _, seconds = os.environ.get("FXMEGA_TEST_PAUSE_BEFORE_RENAME", "").partition(":")
    if at and int(at) == step:
        log.info("checkpoint: files written, pausing before the rename")
        time.sleep(float(seconds))


def save(root: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
         keep_last: int = 0, files: dict[str, Path] | None = None) -> Path:
    """A synchronous save (see ``Checkpointer``)."""
    return Checkpointer(root, keep_last).save(step, tensors, meta, files)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None if there is none yet."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    target = Path(root) / pointer.read_text().strip()
    if not target.is_dir():
        raise CheckpointError(f"{pointer} names {target.name}, which does not exist: the checkpoint was moved or "
                              f"deleted; point 'latest' at a complete step_* directory")
    return target


def resolve(path: str | Path) -> Path | None:
    """A checkpoint directory from ``--load``: a root (its ``latest``), or one step directory."""
    p = Path(path)
    if (p / META).is_file() or (p / ".metadata").is_file():
        return p
    return latest(p)


def check(path: Path) -> dict[str, Any]:
    """Verify a checkpoint before loading it and return its meta. Every rank takes part:
    rank 0 checks every file against the manifest (one shared filesystem), and all ranks
    raise if any found a problem, so no rank is left waiting in a collective."""
    error = ""
    try:
        meta = read_meta(path)
        verify(path) if _rank() == 0 or not _distributed() else None
    except CheckpointError as e:
        error, meta = str(e), {}
    if _distributed():
        flags = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flags)
        if flags.item() and not error:
            error = f"another rank found checkpoint {path} damaged (see its error)"
    if error:
        raise CheckpointError(error)
    return meta


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in the checkpoint, from its (safely read) metadata."""
    metadata = SafeReader(str(path)).read_metadata()
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def load(path: str | Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load the checkpoint at ``path`` into ``template`` (a flat dict of tensors, filled in
    place). Tensors in the template decide shapes and placements, so a checkpoint loads
    onto another mesh (DCP reshards). Call ``check`` first."""
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            with torch.no_grad():  # parameters are leaves that require grad; loading overwrites them
                dcp.load(template, storage_reader=SafeReader(str(path)), no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's own exception derives from BaseException
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {_first_line(e)}") from e
    return template
