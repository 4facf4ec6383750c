#!/usr/bin/env python3
"""Muon against AdamW on the `make run` model (configs/shakespeare_gpt.py), in one process.

1. A small sweep: each optimizer at three learning rates (the same grid: Muon's update is
   scaled to AdamW's RMS, so the learning rates mean the same), ``--steps`` steps of the
   config's cosine schedule shortened to that length, the validation loss every
   ``--eval-every`` steps with the training time spent so far (compiled steps only; the
   first step, which compiles, and the evaluations are not counted). Prints every run, each
   optimizer's best at equal steps, and the validation loss each best reaches by the time
   budget of the faster of the two (equal wall time).
2. The cost of Newton-Schulz: one Muon update against one AdamW update over the same
   parameters (eager, fp32 on CPU, bf16 NS on CUDA), at the `make run` model's shapes and
   at GPT-2 124M's, with the analytic FLOPs of the 5 iterations.

    python bench/muon.py [--steps 300] [--eval-every 50] [--lrs 1.5e-3,3e-3,6e-3] [--skip-sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fxmega.config import load, override  # noqa: E402
from fxmega.core import tree  # noqa: E402
from fxmega.models import gpt, model_for  # noqa: E402
from fxmega.optim.adamw import AdamWHyper  # noqa: E402
from fxmega.optim.muon import Muon, MuonHyper  # noqa: E402
from fxmega.optim.optimizer import optimizer_for  # noqa: E402
from fxmega.training.optim import param_roles  # noqa: E402
from fxmega.training.run import Run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def train(optimizer: str, lr: float, steps: int, eval_every: int, eval_iters: int) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, validation loss) every ``eval_every`` steps."""
    cfg = override(load(ROOT / "configs" / "shakespeare_gpt.py"),
                   [f"optim.optimizer={optimizer}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}",
                    f"train.steps={steps}", f"train.eval_iters={eval_iters}", "train.eval_interval=0",
                    "train.save_dir=", "train.log_jsonl=", "train.tensorboard_dir=", "train.sample_tokens=0"])
    run = Run(cfg)
    run.do_step()  # compiles
    seconds, out = 0.0, []
    for step in range(2, steps + 1):
        t0 = time.perf_counter()
        run.do_step()["loss"]  # the metrics' read waits for the step
        seconds += time.perf_counter() - t0
        if step % eval_every == 0:
            out.append((step, seconds, run.evaluate()))
    return out


def at_time(curve: list[tuple[int, float, float]], budget: float) -> tuple[int, float]:
    """The last evaluation within ``budget`` training seconds: (step, validation loss)."""
    within = [(s, v) for s, t, v in curve if t <= budget * (1 + 1e-9)]
    return within[-1] if within else (0, float("nan"))


def sweep(args: argparse.Namespace) -> None:
    lrs = [float(x) for x in args.lrs.split(",")]
    curves = {(opt, lr): train(opt, lr, args.steps, args.eval_every, args.eval_iters)
              for opt in ("adamw", "muon") for lr in lrs}
    print(f"\nthe make run model, {args.steps} steps, cosine to lr/10, validation loss over {args.eval_iters} "
          f"batches; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| optimizer | lr | valid loss at the end | s/step (median interval) |")
    print("|---|---|---|---|")
    for (opt, lr), curve in curves.items():
        per_step = statistics.median((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(curve, curve[1:]))
        print(f"| {opt} | {lr:g} | {curve[-1][2]:.4f} | {per_step:.3f} |")
    best = {opt: min(((lr, c) for (o, lr), c in curves.items() if o == opt), key=lambda x: x[1][-1][2])
            for opt in ("adamw", "muon")}
    budget = min(c[-1][1] for _, c in best.values())
    print(f"\nequal steps ({args.steps}) and equal training time ({budget:.0f} s, the faster best run's):")
    print("| optimizer | best lr | valid loss, equal steps | valid loss, equal time (at step) |")
    print("|---|---|---|---|")
    for opt, (lr, curve) in best.items():
        step, loss = at_time(curve, budget)
        print(f"| {opt} | {lr:g} | {curve[-1][2]:.4f} | {loss:.4f} ({step}) |")


def update_cost(name: str, cfg: gpt.Config, device: torch.device, repeats: int) -> None:
    """One Muon update against one AdamW update over ``cfg``'s parameters."""
    specs = model_for(cfg).param_specs(cfg)
    params = [torch.randn(s.shape, device=device) * 0.02 for s in tree.leaves(specs)]
    roles = param_roles(specs)
    flops = 0
    for role, spec in zip(roles, tree.leaves(specs)):
        if role.matrix is not None:
            n, rows, cols = role.matrix.shape(spec.shape)
            a, b = min(rows, cols), max(rows, cols)
            flops += n * 5 * 2 * (a * a * b + a * a * a + a * a * b)  # Gram, its square, the product, per step
    times = {}
    for label, optimizer in (("adamw", optimizer_for(load(ROOT / "configs" / "shakespeare_gpt.py").optim)),
                             ("muon", Muon(MuonHyper(), AdamWHyper()))):
        state = {"step": torch.zeros((), device=device), "exp_avg": [torch.zeros_like(p) for p in params],
                 "exp_avg_sq": [torch.zeros_like(p) for p in params]}
        runs = []
        for _ in range(repeats + 1):
            grads = [torch.randn_like(p) for p in params]
            t0 = time.perf_counter()
            optimizer.update(params, grads, state, torch.tensor(1e-4, device=device), roles,
                             torch.ones((), device=device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        times[label] = statistics.median(runs[1:])
    n_params = sum(p.numel() for p in params)
    print(f"| {name} ({n_params / 1e6:.1f}M) | {times['adamw'] * 1e3:.1f} ms | {times['muon'] * 1e3:.1f} ms | "
          f"{flops / 1e9:.1f} GFLOP | {flops / times['muon'] / 1e9:.0f} GFLOP/s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--lrs", default="1.5e-3,3e-3,6e-3")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if not args.skip_sweep:
        sweep(args)
    device = torch.device(args.device)
    print(f"\none optimizer update, eager, {device}:")
    print("| parameters | AdamW | Muon | Newton-Schulz FLOPs | Muon's rate |")
    print("|---|---|---|---|---|")
    update_cost("make run model", load(ROOT / "configs" / "shakespeare_gpt.py").model, device, 5)
    update_cost("GPT-2 124M", load(ROOT / "configs" / "gpt2_124m.py").model, device, 2)


if __name__ == "__main__":
    main()
