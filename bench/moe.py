#!/usr/bin/env python3
"""Mixture of experts on this machine: step time and memory of a small MoE against a dense
model with the same active parameters per token, dropless against capacity-bound experts,
and against plain PyTorch (transformers' Mixtral, eager, torch.optim.AdamW) in the same run.

  dense          Llama, d_ff = k x d_expert: the FFN FLOPs one token spends in the MoE
  moe dropless   8 experts, top 2; every token reaches both of its experts
  moe capacity   the same, expert buffers of 1.25 x tokens x k / E rows per sequence
  plain Mixtral  transformers' MixtralForCausalLM of the same shape (its experts loop)

On a CPU (or in fp32) the dropless experts take torch's masked fallback, which computes
every expert on every routed row (E times the FLOPs; ``fxmega/ops/experts.py``); on CUDA in
bf16 they are one grouped matrix product. The capacity mode is one batched product over
fixed buffers everywhere. Peak memory is the step's high-water mark above the resident set
(CPU) or the allocator's peak (CUDA).

With ``--ep 2`` (the default) the two MoE rows run again with their experts split over 2
local processes (gloo, ``--mesh dp=2,ep=2``: each rank half the batch and half the experts),
and the bytes each rank sends over ep per step, counted in the compiled graph, are set
against the least a balanced routing must send: every (token, expert) pair whose expert
lives on another rank goes there and comes back, forward and backward —
4 x (ep-1)/ep x k x tokens x d x 4 bytes per layer. The buffers are fixed-size, so the
capacity mode sends its capacity factor over that and dropless over ep (each expert's buffer
holds a whole sequence) E / k times it.

    python bench/moe.py [--d-model 128 --layers 2 --seq 128 --batch 8 --steps 5 --backend inductor --ep 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxmega.config import DataConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from fxmega.core import tree  # noqa: E402
from fxmega.core.memory import current_bytes, peak_bytes, reset_peak  # noqa: E402
from fxmega.models import llama, mixtral  # noqa: E402
from fxmega.ops.moe import MoE  # noqa: E402
from fxmega.training.run import Run  # noqa: E402

EXPERTS, TOP_K = 8, 2


def shapes(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab, max_seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                n_heads=4, n_kv_heads=2)


def run_config(model, args: argparse.Namespace, ep: int = 1) -> RunConfig:
    return RunConfig(name="bench_moe", model=model,
                     train=TrainConfig(steps=args.steps + 2, micro_batch_size=args.batch // ep,
                                       global_batch_size=args.batch, seq_len=args.seq, eval_interval=0,
                                       device=args.device, compile_backend=args.backend),
                     optim=OptimConfig(lr=1e-3, warmup_steps=0), data=DataConfig(source="mock"),
                     parallel=ParallelConfig(mesh=f"dp={ep},ep={ep}" if ep > 1 else "1"))


def models(args: argparse.Namespace) -> dict:
    base = shapes(args)
    moe = MoE(n_experts=EXPERTS, top_k=TOP_K, d_expert=args.d_expert, aux_loss_coeff=0.01)
    return {
        "dense (same active FFN)": llama.Config(**base, d_ff=TOP_K * args.d_expert),
        "moe dropless": mixtral.Config(**base, d_ff=args.d_expert, moe=moe),
        "moe capacity 1.25": mixtral.Config(**base, d_ff=args.d_expert, moe=replace(moe, capacity_factor=1.25)),
    }


def time_steps(step, device: torch.device, steps: int) -> tuple[float, int]:
    """Seconds per step (median after two warm-up steps) and the peak bytes above resident."""
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    base = current_bytes(device)
    reset_peak(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak_bytes(device) - base


def fxmega_row(model, args: argparse.Namespace) -> tuple[float, int, int]:
    run = Run(run_config(model, args))
    n = sum(t.numel() for t in tree.leaves(run.params))
    seconds, peak = time_steps(run.do_step, run.device, args.steps)
    return seconds, peak, n


def plain_mixtral_row(args: argparse.Namespace, device: torch.device) -> tuple[float, int, int]:
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_expert,
                                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=args.seq, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, attn_implementation="sdpa",
                                     experts_implementation="eager")
    model = transformers.MixtralForCausalLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)

    def step() -> None:
        out = model(tokens[:, :-1], labels=tokens[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, peak = time_steps(step, device, args.steps)
    return seconds, peak, sum(p.numel() for p in model.parameters())


def ep_worker(name: str, args: argparse.Namespace) -> None:
    """One rank of an ep run: time its steps, count what it sends over ep in the compiled
    graph; rank 0 prints the slowest step time and the largest peak and bytes."""
    import torch.distributed as dist

    from fxmega.compiler.inspect import record_collectives
    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec

    cfg = run_config(models(args)[name], args, args.ep)
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    with record_collectives() as graphs:
        run.do_step()  # compiles
    labels = par.groups.labels()
    sent = sum(c.bytes_sent_per_rank for g in graphs for c in g
               if labels.get(c.group) == "ep" and c.op.startswith("all_to_all"))
    seconds, peak = time_steps(run.do_step, device, args.steps)
    mine = {"seconds": seconds, "peak": peak, "sent": sent}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({k: max(r[k] for r in every) for k in mine}), flush=True)


def ep_row(name: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    argv = [a for a in sys.argv[1:] if not a.startswith("--one")]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={args.ep}", __file__, *argv, f"--one={name}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{name} over ep={args.ep} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--d-expert", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks for the ep rows (0: none)")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one rank of an ep row, started by torch.distributed.run
        from fxmega.parallel.distributed import per_rank_caches, shutdown

        per_rank_caches()
        try:
            ep_worker(args.one, args)
        finally:
            shutdown()
        sys.stdout.flush()
        os._exit(0)
    rows = models(args)
    tokens = args.batch * args.seq
    print(f"torch {torch.__version__}, {args.batch}x{args.seq} tokens per step, d={args.d_model} L={args.layers}, "
          f"{EXPERTS} experts of width {args.d_expert}, top {TOP_K}, fp32, fxmega compiled with {args.backend}")
    print(f"{'model':<28}{'parameters':>12}{'tokens/s':>12}{'peak':>12}")
    device = None
    for name, model in rows.items():
        seconds, peak, n = fxmega_row(model, args)
        device = device or torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
        print(f"{'fxmega ' + name:<28}{n:>12,}{tokens / seconds:>12,.0f}{peak / 2**20:>9,.0f} MiB", flush=True)
    seconds, peak, n = plain_mixtral_row(args, device)
    print(f"{'plain Mixtral (eager)':<28}{n:>12,}{tokens / seconds:>12,.0f}{peak / 2**20:>9,.0f} MiB", flush=True)
    if args.ep > 1:
        minimum = 4 * (args.ep - 1) / args.ep * TOP_K * (tokens // args.ep) * args.d_model * 4 * args.layers
        print(f"\nexperts over ep={args.ep} ({args.ep} gloo processes, --mesh dp={args.ep},ep={args.ep}); bytes "
              f"each rank sends over ep per step against a balanced routing's least ({minimum / 2**20:.2f} MiB)")
        print(f"{'model':<28}{'tokens/s':>12}{'peak/rank':>12}{'ep sent':>12}{'ratio':>8}")
        for name in ("moe dropless", "moe capacity 1.25"):
            r = ep_row(name, args)
            print(f"{'fxmega ' + name:<28}{tokens / r['seconds']:>12,.0f}{r['peak'] / 2**20:>9,.0f} MiB"
                  f"{r['sent'] / 2**20:>8,.2f} MiB{r['sent'] / minimum:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
