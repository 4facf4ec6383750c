"""Run a function on several local gloo ranks, each in a fresh process, and collect what
each returns. What makes this reliable on small CPU machines (each learned the hard way):
a per-rank inductor cache, OMP_NUM_THREADS=1, a process-group timeout, and os._exit at the
end of every worker (workers otherwise sometimes abort at exit)."""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "inductor-ranks" / (os.environ.get("ATEN_CPU_CAPABILITY") or "native")  # see conftest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, target: str, args: tuple, queue: Any, env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "TORCHINDUCTOR_CACHE_DIR": str(CACHE / f"world{world}-rank{rank}"), **env})
    code = 1
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
        module, _, name = target.partition(":")
        result = getattr(importlib.import_module(module), name)(*args)
        # pickled here, not by the queue: torch's queue pickler shares tensor memory through
        # file descriptors that die with this process
        queue.put((rank, "ok", pickle.dumps(result)))
        code = 0
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # os._exit would otherwise drop what the queue has not sent yet
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _crashed(procs: list, results: dict, errors: dict) -> bool:
    """Whether a rank ended without a word: killed by a signal, or exited before its answer."""
    return any(p.exitcode is not None and r not in results and r not in errors for r, p in enumerate(procs))


def run_ranks(world: int, target: str, *args: Any, timeout: float = 900, env: dict | None = None) -> list[Any]:
    """``target`` ("module:function") called on ``world`` ranks; returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, target, args, queue, env or {})) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                if (errors or _crashed(procs, results, errors)) and deadline > time.monotonic() + 5:
                    # a rank failed or died: the others get 5 s to say what they saw of it
                    deadline = time.monotonic() + 5
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors or len(results) < world:
        # every rank's own account, and how each process ended: a peer's "Connection closed by
        # peer" names only the symptom of another rank dying (a signal shows as a negative code)
        lines = [f"rank {r}: exit code {p.exitcode}" + (f" (signal {-p.exitcode})" if (p.exitcode or 0) < 0 else "")
                 for r, p in enumerate(procs)]
        if not errors and all(p.exitcode is None or p.exitcode == 0 for p in procs):
            lines.append(f"no result within {timeout:.0f} s (ranks done: {sorted(results)})")
        raise AssertionError("a rank failed\n" + "\n".join(lines) + "".join(
            f"\nrank {r}:\n{text}" for r, text in sorted(errors.items())))
    return [results[r] for r in range(world)]
