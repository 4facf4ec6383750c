#!/usr/bin/env python3
"""Step time with collectives overlapped by inductor's passes (``--overlap-comm``) and without,
on 2 local ranks (gloo), with the exposed-communication figure read from the generated code.

For each strategy — DP, ZeRO-1 as the distributed optimizer, ZeRO-3 — on dp=2, the step is
compiled with inductor twice (``parallel.overlap_comm`` off and on); the table gives the
median step time over the timed steps, the collectives in the step's generated code, how
many of them have no kernel between their start and their wait (exposed), and the kernels
the others run meanwhile (``fxmega.compiler.generated_code.kernels_before_waits``).

    python bench/overlap.py [--steps 6]     # starts 2 local processes itself
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STRATEGIES = {"DP": dict(mesh="dp=2"), "ZeRO-1 (distributed optimizer)": dict(mesh="dp=2", zero=1,
                                                                             distributed_optimizer=True),
              "ZeRO-3": dict(mesh="dp=2", zero=3),
              # the updated shards gathered at the next step's start (needs the overlap passes: on only)
              "ZeRO-1, gather in the next step (--overlap-param-gather)": dict(
                  mesh="dp=2", zero=1, distributed_optimizer=True, overlap_param_gather=True)}
# big enough that the gradient reductions take time next to the compute: 12.7M parameters
MODEL = ["model.vocab_size=4096", "model.d_model=512", "model.n_heads=8", "model.n_layers=4", "model.max_seq_len=128",
         "train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=8", "train.compile=true",
         "data.source=mock", "parallel.bucket_size=2000000"]


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from fxmega.compiler.generated_code import kernels_before_waits
    from fxmega.config import ParallelConfig, load, override
    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.training.run import Run

    rows = []
    for name, parallel in STRATEGIES.items():
        for on in (True,) if parallel.get("overlap_param_gather") else (False, True):
            cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), MODEL)
            cfg = dataclasses.replace(cfg, parallel=ParallelConfig(**parallel, bucket_size=cfg.parallel.bucket_size,
                                                                   overlap_comm=on))
            par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
            run = Run(cfg, par, device)
            torch._dynamo.reset()
            _, codes = run_and_get_code(run.do_step)  # compiles
            run.do_step()
            times = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                run.do_step()  # returns the step's metrics on the host: the step is done
                times.append(time.perf_counter() - start)
            hidden = [n for code in codes for _, n in kernels_before_waits(code)]
            rows.append((name, "on" if on else "off", statistics.median(times), len(hidden),
                         sum(1 for n in hidden if n == 0), sum(hidden)))
    if dist.get_rank() == 0:
        print(f"\ndp=2 on gloo, GPT d=512 L=4 vocab 4096, micro batch 4 x 128 tokens, {steps} timed steps, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs")
        print("| strategy | overlap | step (median) | collectives | exposed (no kernel before the wait) "
              "| kernels behind the others |")
        print("|---|---|---|---|---|---|")
        for name, on, step, n, exposed, behind in rows:
            print(f"| {name} | {on} | {step * 1e3:.0f} ms | {n} | {exposed} | {behind} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        from fxmega.cli.launch import start_ranks

        sys.exit(start_ranks(2, sys.argv[1:]))
    os.environ.setdefault("FXMEGA_INDUCTOR_CACHE_BASE", str(ROOT / ".cache" / "inductor-bench"))
    from fxmega.parallel.distributed import per_rank_caches, shutdown

    per_rank_caches()
    try:
        worker(args.steps)
    finally:
        shutdown()
    sys.stdout.flush()
    os._exit(0)
