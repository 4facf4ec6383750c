#!/usr/bin/env python3
"""Context parallelism on this machine: memory per rank and step time against sequence
length for cp = 1, 2, 4, and what each cp attention mode sends against its minimum.

A fixed small Llama (d=128, 8 heads, 4 kv heads, 2 layers, vocabulary 256), one sequence per
step, compiled with aot_eager (the graph and its collectives; inductor's kernels would
change the times, not the bytes). cp=1 is one process; cp=2 and cp=4 start their local
processes (gloo). Per run: the step's peak memory above the resident set, per rank (the
largest rank), the mean time of steps 2-3, and the bytes each rank sends over cp per step,
counted from the compiled graph, beside the least the mode must send:

  allgather  the other ranks' keys and values reach every rank, and their gradients
             come back: 2 (W-1)/W x (K + V of the whole sequence) per layer
  a2a        q, k, v and the output are transposed forward and their gradients backward:
             2 (W-1)/W x (q + k + v + output of this rank's tokens) per layer
  ring       k and v move W-1 steps forward and again backward, where their gradients
             move W steps (the last one home): ((W-1) 2 + W) x (K + V of this rank's
             tokens) per layer (it keeps no other rank's keys, so it sends more)
  both       every parameter's gradient is summed over cp: 2 (W-1)/W x P (compute dtype)

The longest sequence of the ladder that a rank fits in ``--budget`` (default 1 GiB per
rank) is marked: context parallelism's point is that it grows with cp.

    python bench/context.py [--budget 1GiB] [--lengths 2048,4096,8192,16384] [--runs 1:allgather,2:ring]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ["model.vocab_size=256", "model.d_model=128", "model.n_heads=8", "model.n_kv_heads=4", "model.n_layers=2",
         "model.d_ff=256", "train.micro_batch_size=1", "train.global_batch_size=1", "train.compile=true",
         "train.compile_backend=aot_eager", "train.device=cpu", "train.eval_interval=0", "data.source=mock"]
STEPS = 3


def config(cp: int, mode: str, seq: int):
    from fxmega.config import load, override

    mesh = f"cp={cp}" if cp > 1 else "1"
    return override(load(ROOT / "configs" / "tiny_llama.py"),
                    [*MODEL, f"train.seq_len={seq}", f"model.max_seq_len={seq}", f"parallel.mesh={mesh}",
                     f"parallel.cp_attention={mode}"])


def minimum(cfg, cp: int, mode: str, param_bytes: int) -> float:
    m, seq = cfg.model, cfg.train.seq_len
    share = (cp - 1) / cp
    hd = m.head_dim
    kv_whole = 2 * seq * m.kv_heads * hd * 4  # k and v of the whole sequence, fp32
    if mode == "allgather":
        attention = 2 * share * kv_whole * m.n_layers  # forward gather, backward reduce-scatter
    elif mode == "ring":
        attention = (2 * (cp - 1) + cp) * kv_whole / cp * m.n_layers
    else:
        local = seq // cp * (2 * m.n_heads + 2 * m.kv_heads) * hd * 4  # q, out, k, v of this rank's tokens
        attention = 2 * share * local * m.n_layers
    return attention + 2 * share * param_bytes


def measure(cp: int, mode: str, seq: int) -> dict:
    """One run on this process's rank (or alone for cp=1)."""
    import torch

    from fxmega.compiler.inspect import record_collectives
    from fxmega.core.memory import current_bytes, peak_bytes, reset_peak
    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.training.run import Run

    cfg = config(cp, mode, seq)
    par, device = (distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh)) if cp > 1 else (None, None))
    run = Run(cfg, par, device)
    torch._dynamo.reset()
    with record_collectives() as graphs:
        run.do_step()  # compiles
    times = []
    base = current_bytes(run.device)
    reset_peak(run.device)
    for _ in range(STEPS - 1):
        t0 = time.perf_counter()
        run.do_step()
        times.append(time.perf_counter() - t0)
    peak = peak_bytes(run.device) - base
    out = {"peak": peak, "step_s": sum(times) / len(times)}
    if par is not None:
        labels = par.groups.labels()
        out["sent"] = sum(c.bytes_sent_per_rank for g in graphs for c in g if labels.get(c.group) == "cp")
        param_bytes = sum(lay.local_numel("param") * 4 for lay in par.shards.layouts)
        out["minimum"] = minimum(cfg, cp, mode, param_bytes)
    return out


def worker(cp: int, mode: str, seq: int) -> None:
    import torch.distributed as dist

    result = measure(cp, mode, seq)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        worst = max(gathered, key=lambda r: r["peak"])
        print("RESULT " + json.dumps({**worst, "step_s": max(r["step_s"] for r in gathered)}), flush=True)


def launch(cp: int, mode: str, seq: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "FXMEGA_INDUCTOR_CACHE_BASE": str(ROOT / ".cache" / "inductor-bench")}
    args = [sys.executable, __file__, "--one", f"{cp},{mode},{seq}"]
    if cp > 1:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
                __file__, "--one", f"{cp},{mode},{seq}"]
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"cp={cp} {mode} seq={seq} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    from fxmega.planning.report import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GiB", help="memory per rank for the longest-sequence column")
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--runs", default="1:allgather,2:allgather,2:ring,2:a2a,4:allgather,4:ring,4:a2a",
                        help="cp:mode pairs to measure")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        cp, mode, seq = args.one.split(",")
        if int(cp) == 1:
            r = measure(1, mode, int(seq))
            print("RESULT " + json.dumps(r), flush=True)
            return
        from fxmega.parallel.distributed import per_rank_caches, shutdown

        per_rank_caches()
        try:
            worker(int(cp), mode, int(seq))
        finally:
            shutdown()
        sys.stdout.flush()
        os._exit(0)
    import torch

    budget = parse_bytes(args.budget)
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"Llama d=128 L=2 (8 heads, 4 kv heads), 1 sequence per step, fp32, aot_eager, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'cp':>3} {'mode':<10}{'sequence':>9}{'peak/rank':>12}{'step s':>9}{'cp sent/step':>14}{'minimum':>12}"
          f"{'ratio':>7}")
    for cp, mode in [(int(cp), mode) for cp, mode in (run.split(":") for run in args.runs.split(","))]:
        longest = 0
        for seq in lengths:
            r = launch(cp, mode, seq)
            fits = r["peak"] <= budget
            longest = seq if fits else longest
            sent = f"{r['sent'] / 2**20:,.2f} MiB" if "sent" in r else "-"
            least = f"{r['minimum'] / 2**20:,.2f} MiB" if "minimum" in r else "-"
            ratio = f"{r['sent'] / r['minimum']:.2f}" if "sent" in r else "-"
            print(f"{cp:>3} {mode if cp > 1 else '-':<10}{seq:>9}{r['peak'] / 2**20:>9,.0f} MiB{r['step_s']:>9.2f}"
                  f"{sent:>14}{least:>12}{ratio:>7}", flush=True)
        print(f"    longest sequence within {args.budget} per rank: {longest or 'none of the ladder'}", flush=True)


if __name__ == "__main__":
    main()
