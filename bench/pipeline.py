#!/usr/bin/env python3
"""Pipeline bubble per schedule: measured idle time over step time, beside the theory.

Each rank runs with one thread (OMP_NUM_THREADS=1). What that thread computes shows up as
its CPU time; while it waits for a neighbouring stage (a blocking gloo receive) it uses
none. So per rank and step:

    bubble = 1 - (CPU time of the main thread) / (wall time)

Communication counts as idle. On localhost it is small next to compute. The table prints
the mean over ranks and steps after warm-up, next to the textbook fractions for p ranks,
m microbatches and v stages per rank:

    GPipe, 1F1B        (p-1) / (m + p - 1)
    interleaved 1F1B   (p-1) / (v·m + p - 1)
    zero bubble (ZB-H1, one stage per rank)   about (p-1) / (3m + p - 1),
                       if forward, input-gradient and weight-gradient passes take equal time

The reference ("1 process") is the same global batch on a single rank, with plain
gradient accumulation and no pipeline.

    python bench/pipeline.py [--pp 2] [--layers 8] [--d-model 256] [--steps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)]


def _config(args, mesh: str, schedule: str, virtual: int, micro_batches: int):
    from fxmega.config import ParallelConfig, load, override

    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), [
        "model.vocab_size=256", f"model.d_model={args.d_model}", "model.n_heads=8", f"model.n_layers={args.layers}",
        f"model.max_seq_len={args.seq}", f"train.seq_len={args.seq}", f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * micro_batches}", "train.compile=false", "train.device=cpu"])
    return dataclasses.replace(cfg, parallel=ParallelConfig(mesh=mesh, pipeline_schedule=schedule,
                                                            virtual_stages=virtual))


def _timed_steps(run, steps: int, barrier) -> list[tuple[float, float]]:
    out = []
    for i in range(steps + 2):  # two warm-up steps
        barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        run.do_step()
        if i >= 2:
            out.append((time.perf_counter() - wall, time.thread_time() - cpu))
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.training.run import Run

    torch.set_num_threads(1)
    p = args.pp
    rows = []
    for m in args.micro_batches:
        for schedule, v in SCHEDULES:
            cfg = _config(args, f"pp={p}", schedule, v, m)
            par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
            times = _timed_steps(Run(cfg, par, device), args.steps, dist.barrier)
            wall = sum(w for w, _ in times) / len(times)
            bubble = torch.tensor(sum(1 - c / w for w, c in times) / len(times))
            dist.all_reduce(bubble)
            theory = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
                      "interleaved-1f1b": (p - 1) / (v * m + p - 1), "zero-bubble": (p - 1) / (3 * m + p - 1)}
            rows.append((m, f"{schedule} (v={v})", wall, float(bubble) / p, theory[schedule]))
    if dist.get_rank() == 0:
        import subprocess

        print(f"\npipeline bubble, pp={p}, GPT d={args.d_model} L={args.layers}, micro batch {args.micro} x "
              f"{args.seq} tokens, eager stages, 1 thread per rank, gloo on localhost")
        print(f"{'m':>3}  {'schedule':<24} {'step s':>8} {'bubble':>8} {'theory':>8} {'1 process s':>12}")
        for m, name, wall, bubble, theory in rows:
            single = subprocess.run([sys.executable, __file__, "--single", str(m), *sys.argv[1:]],
                                    capture_output=True, text=True, env={**os.environ, "RANK": ""}).stdout.strip()
            print(f"{m:>3}  {name:<24} {wall:>8.3f} {bubble:>8.1%} {theory:>8.1%} {single:>12}")


def single(args, m: int) -> None:
    import torch

    from fxmega.training.run import Run

    torch.set_num_threads(1)
    cfg = _config(args, "1", "1f1b", 1, m)
    times = _timed_steps(Run(cfg), args.steps, lambda: None)
    print(f"{sum(w for w, _ in times) / len(times):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--single", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        os.environ.pop("RANK", None)
        return single(args, args.single)
    if not os.environ.get("RANK"):
        from fxmega.cli.launch import start_ranks

        sys.exit(start_ranks(args.pp, sys.argv[1:]))
    from fxmega.parallel.distributed import per_rank_caches, shutdown

    per_rank_caches()
    try:
        worker(args)
    finally:
        shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
