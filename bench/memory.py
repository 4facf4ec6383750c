#!/usr/bin/env python3
"""Memory and speed of a compiled training step, on this machine, in one run:

1. **Precision x recompute** on one device: for a fixed GPT whose activations dominate, the
   peak memory the step adds above the resident set before it (CPU: resident-set high-water
   mark; CUDA: allocator peak) and tokens/s, for fp32/bf16/fp16 and recompute none /
   selective / full — against plain PyTorch (an nn.Module under torch.compile, AdamW,
   autocast for bf16, torch.utils.checkpoint per block for "full").
2. **ZeRO stages** on 2 local ranks (``--zero``; slower): a GPT whose parameters dominate
   memory trains on dp=2; the state a rank keeps between steps (parameters and AdamW
   moments, exact) and what the step adds on top at its peak.

Every variant runs in a fresh process (glibc set to return freed blocks at once), so one
variant's freed memory cannot hide the next one's. "ZeRO-3, gathers kept" turns off the
re-gather in the backward: every block's gathered parameters then live from the forward to
the backward.

    python bench/memory.py [--d-model 256 --layers 4 --seq 512 --batch 8] [--zero]
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


COMPUTE_VARIANTS = [("fp32", "none"), ("fp32", "selective"), ("fp32", "full"), ("bf16", "none"),
                    ("bf16", "selective"), ("bf16", "full"), ("fp16", "none")]
PLAIN_VARIANTS = [("fp32", "none"), ("fp32", "full"), ("bf16", "none")]


def compute_worker(kind: str, precision: str, recompute: str, d: int, layers: int, seq: int, batch: int,
                   steps: int) -> dict:
    """One variant in this (fresh) process: warm up (compile), then time ``steps`` steps and
    take the peak memory the steps add above the resident set before them."""
    import time

    import torch

    from fxmega.core.memory import current_bytes, peak_bytes, reset_peak

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if kind == "fxmega":
        from fxmega.config import ComputeConfig, DataConfig, OptimConfig, RunConfig, TrainConfig
        from fxmega.models import gpt
        from fxmega.training.run import Run

        cfg = RunConfig(model=gpt.Config(vocab_size=256, max_seq_len=seq, d_model=d, n_layers=layers, n_heads=8),
                        train=TrainConfig(steps=10**6, micro_batch_size=batch, global_batch_size=batch, seq_len=seq,
                                          device=device.type),
                        optim=OptimConfig(lr=1e-4, schedule="constant", clip_grad=1.0),
                        data=DataConfig(source="mock"),
                        compute=ComputeConfig(precision=precision, recompute=recompute,
                                              initial_loss_scale=2.0**12))
        run = Run(cfg)
        step = run.do_step
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from plain_gpt import PlainGPT

        torch.manual_seed(0)
        model = PlainGPT(256, seq, d, layers, 8, checkpoint_blocks=recompute == "full").to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        fwd = torch.compile(model)
        tokens = torch.randint(0, 256, (batch, seq + 1), device=device)
        dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]

        def step() -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = fwd(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()

    for _ in range(2):
        step()
    sync()
    reset_peak(device)
    before = current_bytes(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    return {"step_bytes": peak_bytes(device) - before, "tokens_per_s": batch * seq / seconds}


def compute_table(args: argparse.Namespace, env: dict) -> None:
    mib = 2**20
    print(f"GPT d_model={args.d_model}, {args.layers} layers, {args.batch} x {args.seq} tokens per step, "
          f"one device; step peak = memory the step adds above what is held between steps")
    print(f"{'method':<10}{'precision':<11}{'recompute':<11}{'step peak MiB':>15}{'tokens/s':>11}")
    variants = [("fxmega", p, r) for p, r in COMPUTE_VARIANTS] + [("plain", p, r) for p, r in PLAIN_VARIANTS]
    for kind, precision, recompute in variants:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--compute-worker", kind, precision, recompute, str(args.d_model),
                   str(args.layers), str(args.seq), str(args.batch), str(args.steps), f.name]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(Path(f.name).read_text())
        plain_recompute = {"full": "full (ckpt)"}.get(recompute, recompute) if kind == "plain" else recompute
        print(f"{kind:<10}{precision:<11}{plain_recompute:<11}{r['step_bytes'] / mib:>15.1f}"
              f"{r['tokens_per_s']:>11,.0f}", flush=True)


def worker(zero: int, regather: bool, d_model: int, layers: int, out: str) -> None:
    import torch.distributed as dist

    from tests.sharding_workers import peak_memory

    result = peak_memory(zero, regather, d_model, layers)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant, after 2 warm-up steps")
    ap.add_argument("--zero", action="store_true", help="also the ZeRO table (2 ranks, a few minutes)")
    ap.add_argument("--zero-d-model", type=int, default=1024)
    ap.add_argument("--zero-layers", type=int, default=8)
    args = ap.parse_args()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "FXMEGA_INDUCTOR_CACHE_BASE": str(ROOT / ".cache" / "inductor-bench"),
           "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor-bench-memory")}
    compute_table(args, env)
    if args.zero:
        print()
        zero_table(args, env)


def zero_table(args: argparse.Namespace, env: dict) -> None:
    mib = 2**20
    args.d_model, args.layers = args.zero_d_model, args.zero_layers
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
    if len(sys.argv) > 1 and sys.argv[1] == "--compute-worker":
        kind, precision, recompute = sys.argv[2:5]
        d, layers, seq, batch, steps = (int(a) for a in sys.argv[5:10])
        Path(sys.argv[10]).write_text(json.dumps(compute_worker(kind, precision, recompute, d, layers, seq, batch,
                                                                steps)))
        sys.stdout.flush()
        os._exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from fxmega.parallel.distributed import per_rank_caches, shutdown

        per_rank_caches()
        try:
            worker(int(sys.argv[2]), bool(int(sys.argv[3])), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        finally:
            shutdown()
        sys.stdout.flush()
        os._exit(0)
    main()
