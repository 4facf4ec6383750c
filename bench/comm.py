#!/usr/bin/env python3
"""Communication per step, counted from the compiled graph, against the analytic minimum.

For each strategy on 2 local ranks (gloo), one compiled training step of a GPT is traced
and every collective in the graph is recorded with its size and process group (an inductor
graph pass, fxmega.compiler.inspect). The table gives, per strategy and mesh axis, the
number of collectives and the bytes each rank sends with ring algorithms, beside the least
that strategy must send:

  DP       all-reduce of every gradient                         2(W-1)/W x P
  ZeRO-1/2 reduce-scatter gradients + all-gather parameters     2(W-1)/W x P
  ZeRO-3   gather in forward and again in backward + reduce-scatter   3(W-1)/W x P
           (the head's parameters are used by the backward right after the forward,
            so they are not gathered twice: a little under 3x)
  TP       Megatron: (4L+2) all-reduces of the activations [B,S,E] + 3 of [B,S] in the loss
  TP + SP  the same volume as reduce-scatters and all-gathers, plus the all-reduce of
           the LayerNorm weights' gradients (they see only 1/tp of the tokens)

P: parameter bytes split this way (parameters without an `embed` dim stay replicated over
the data axis and are all-reduced: 2(W-1)/W of their bytes). Two scalars per step are not
counted in the minimum: the loss (over the data axis) and the gradient norm (over all
ranks).

    python bench/comm.py            # starts 2 local processes itself
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the strategies of tests/sharding_workers.py, with the names this table prints
LABELS = {"dp2": "DP (dp=2)", "zero1": "ZeRO-1 (dp=2)", "zero2": "ZeRO-2 (dp=2)", "zero3": "ZeRO-3 (dp=2)",
          "fsdp2": "FSDP (fsdp=2)", "tp2": "TP (tp=2)", "tp2_sp": "TP + SP (tp=2)"}
MODEL = ["model.vocab_size=256", "model.d_model=256", "model.n_heads=8", "model.n_layers=2", "model.max_seq_len=64",
         "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "train.compile=true"]


def minimum(name: str, par, cfg) -> dict[str, float]:
    """Least bytes each rank must send per step, by mesh axis."""
    w = 2
    ring_ar = 2 * (w - 1) / w
    sharded = sum(lay.local_numel("param") * 4 for lay in par.shards.layouts if lay.zero_dim is not None)
    replicated = sum(lay.local_numel("param") * 4 for lay in par.shards.layouts if lay.zero_dim is None)
    if name.startswith(("DP", "ZeRO-1", "ZeRO-2")):
        return {"dp": ring_ar * (sharded + replicated)}
    if name.startswith(("ZeRO-3", "FSDP")):
        axis = "dp" if name.startswith("ZeRO") else "fsdp"
        # sharded is this rank's shard: the full parameters are w times that
        return {axis: 3 * (w - 1) / w * sharded * w + ring_ar * replicated}
    m, t = cfg.model, cfg.train
    bse = t.micro_batch_size * t.seq_len * m.d_model * 4
    bs = t.micro_batch_size * t.seq_len * 4
    volume = (4 * m.n_layers + 2) * ring_ar * bse + 3 * ring_ar * bs
    if "SP" in name:
        norms = sum(lay.local_numel("param") * 4 for lay in par.shards.layouts if lay.axes == ("embed",))
        volume += ring_ar * norms
    return {"tp": volume}


def worker() -> None:
    import torch
    import torch.distributed as dist

    from fxmega.compiler.inspect import record_collectives
    from fxmega.config import ParallelConfig, load, override
    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.training.run import Run
    from tests.sharding_workers import STRATEGIES

    rows = []
    for key, parallel in STRATEGIES.items():
        name = LABELS[key]
        cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), MODEL)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        torch._dynamo.reset()
        with record_collectives() as graphs:
            run.do_step()
        labels = par.groups.labels()
        per_axis: dict[str, list] = {}
        for c in graphs[0]:
            axis = labels.get(c.group, c.group)
            per_axis.setdefault(axis, []).append(c)
        least = minimum(name, par, cfg)
        for axis, cs in sorted(per_axis.items()):
            sent = sum(c.bytes_sent_per_rank for c in cs)
            ops = ", ".join(f"{n} {op.replace('_into_tensor', '').replace('_tensor', '')}"
                            for op, n in sorted(_count(cs).items()))
            rows.append((name, axis, ops, sent, least.get(axis)))
    if dist.get_rank() == 0:
        print(f"\nbytes each rank sends per training step (ring algorithms), GPT d=256 L=2 vocab 256, "
              f"micro batch 4 x 64 tokens, torch {torch.__version__}")
        print(f"{'strategy':<16}{'axis':<7}{'collectives in the compiled graph':<52}"
              f"{'sent':>12}{'minimum':>12}{'ratio':>8}")
        for name, axis, ops, sent, least in rows:
            ratio = f"{sent / least:.3f}" if least else "-"
            low = f"{least / 1024:,.1f} KiB" if least else "scalars"
            print(f"{name:<16}{axis:<7}{ops:<52}{sent / 1024:>8,.1f} KiB{low:>12}{ratio:>8}")


def _count(cs):
    from collections import Counter

    return Counter(c.op for c in cs)


if __name__ == "__main__":
    if "RANK" not in os.environ:
        from fxmega.cli.launch import start_ranks

        sys.exit(start_ranks(2, []))
    os.environ.setdefault("FXMEGA_INDUCTOR_CACHE_BASE", str(ROOT / ".cache" / "inductor-bench"))
    from fxmega.parallel.distributed import per_rank_caches, shutdown

    per_rank_caches()
    try:
        worker()
    finally:
        shutdown()
    sys.stdout.flush()
    os._exit(0)
