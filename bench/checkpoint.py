#!/usr/bin/env python3
"""Checkpoint throughput for a ~1 GB training state on this machine, in one run:

  torch.save / torch.load       plain PyTorch, one file (the baseline)
  fxmega sync save / load       DCP + manifest (CRC-32 of every file) + atomic rename;
                                the load verifies the manifest first
  fxmega async save             DCP async_save: the loop blocks only while tensors are
                                copied to CPU memory; the write overlaps the next steps

For the async row, "blocked" is the time the training loop waited (the save call plus
the wait at the next save), measured while the loop keeps running matmul "steps".

    python bench/checkpoint.py [--gb 1.0] [--dir /tmp/fxmega-ckpt-bench]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxmega.storage import checkpoint  # noqa: E402


def state(gb: float) -> dict[str, torch.Tensor]:
    """Parameters and two AdamW moments of a model with ~gb/12 G parameters, in 64 tensors."""
    per = int(gb * 2**30 / 4 / 3 / 64)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(64):
        out[f"params.t{i}"] = torch.randn(per, generator=g)
        out[f"opt.exp_avg.t{i}"] = torch.randn(per, generator=g)
        out[f"opt.exp_avg_sq.t{i}"] = torch.rand(per, generator=g)
    return out


def _step(a: torch.Tensor) -> None:
    torch.mm(a, a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="fxmega-ckpt-bench-"))
    tensors = state(args.gb)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    gb = size / 1e9
    rows = []

    t0 = time.perf_counter()
    torch.save(tensors, base / "plain.pt")
    rows.append(("torch.save (baseline)", time.perf_counter() - t0, None))
    t0 = time.perf_counter()
    torch.load(base / "plain.pt", weights_only=True)
    rows.append(("torch.load (baseline)", time.perf_counter() - t0, None))

    t0 = time.perf_counter()
    path = checkpoint.save(base / "sync", 1, tensors, {"step": 1})
    rows.append(("fxmega save, sync", time.perf_counter() - t0, None))
    template = {k: torch.empty_like(v) for k, v in tensors.items()}
    t0 = time.perf_counter()
    checkpoint.check(path)
    checkpoint.load(path, template)
    rows.append(("fxmega load (verify + read)", time.perf_counter() - t0, None))
    assert all(torch.equal(template[k], v) for k, v in tensors.items())

    a = torch.randn(512, 512)
    saver = checkpoint.Checkpointer(base / "async", async_save=True)
    t0 = time.perf_counter()
    saver.save(1, tensors, {"step": 1})
    steps = 0
    while saver._pending is not None and not saver._pending[0].done():  # keep "training" while it writes
        _step(a)
        steps += 1
    saver.wait()
    total = time.perf_counter() - t0
    rows.append(("fxmega save, async", total, saver.blocked_s))

    print(f"\ncheckpoint of {gb:.2f} GB (192 fp32 tensors), {base}, torch {torch.__version__}")
    print(f"{'method':<30} {'seconds':>8} {'GB/s':>7} {'loop blocked s':>15}")
    for name, seconds, blocked in rows:
        b = f"{blocked:>15.2f}" if blocked is not None else f"{'':>15}"
        print(f"{name:<30} {seconds:>8.2f} {gb / seconds:>7.2f} {b}")
    print(f"(async: {steps} matmul steps ran while the checkpoint was written)")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
