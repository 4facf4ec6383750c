#!/usr/bin/env python3
"""Memory per rank during a compiled training step, by ZeRO stage, on 2 local ranks.

A GPT whose parameters dominate memory (d=1024, 8 layers, tiny batches) trains on dp=2.
For each variant the table gives the state a rank keeps between steps (parameters and
AdamW moments, exact) and what the step adds on top at its peak, measured as the
resident-set high-water mark minus the resident set before the step (glibc set to return
freed blocks at once). Each variant runs in fresh processes, so one variant's freed
memory cannot hide the next one's.

"ZeRO-3, gathers kept" turns off the re-gather in the backward: every block's gathered
parameters then live from the forward to the backward — what the compiled step does by
default without fxmega's recompute policy.

    python bench/memory.py [--d-model 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = [("ZeRO-0 (plain DP)", 0, True), ("ZeRO-1", 1, True), ("ZeRO-2", 2, True), ("ZeRO-3", 3, True),
            ("ZeRO-3, gathers kept", 3, False)]


def worker(zero: int, regather: bool, d_model: int, layers: int, out: str) -> None:
    import torch.distributed as dist

    from tests.sharding_workers import peak_memory

    result = peak_memory(zero, regather, d_model, layers)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "FXMEGA_INDUCTOR_CACHE_BASE": str(ROOT / ".cache" / "inductor-bench")}
    mib = 2**20
    print(f"GPT d_model={args.d_model}, {args.layers} layers, dp=2; MiB per rank")
    print(f"{'variant':<22}{'state':>10}{'step peak':>12}{'total':>10}")
    for name, zero, regather in VARIANTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--worker", str(zero), str(int(regather)), str(args.d_model), str(args.layers), f.name]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = json.loads(Path(f.name).read_text())
        print(f"{name:<22}{r['state'] / mib:>10.1f}{r['step'] / mib:>12.1f}{(r['state'] + r['step']) / mib:>10.1f}",
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from fxmega.sharding.distributed import per_rank_caches, shutdown

        per_rank_caches()
        try:
            worker(int(sys.argv[2]), bool(int(sys.argv[3])), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        finally:
            shutdown()
        sys.stdout.flush()
        os._exit(0)
    main()
