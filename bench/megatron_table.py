#!/usr/bin/env python3
"""fxmega's planner on the GPT configurations of Megatron-Core's published H100 table
(Megatron-LM README, images/model_table.png, r0.8.0: vocab 131,072, sequence 4,096, bf16):
the per-device memory fxmega estimates for Megatron's own TP/PP/DP, and the layout fxmega's
automatic planner picks for the same GPUs and global batch (80 GB H100, micro batch 1).

Assumptions (the table gives none of these): micro batch 1, ZeRO-1 as Megatron's distributed
optimizer (flat buffers: dp=48 shards any hidden size), sequence parallelism when TP > 1, no
recompute, 1F1B. fxmega's GPT ties the input and output embeddings (Megatron's configurations
do not), so its parameter count is V x h lower. Prints a markdown table.

    python bench/megatron_table.py [--only 1.7B,7.1B]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from fxmega.config import ComputeConfig, ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from fxmega.models import gpt  # noqa: E402
from fxmega.ops.init import count_params  # noqa: E402
from fxmega.parallel.strategy import plan_from  # noqa: E402
from fxmega.planning import auto, devices  # noqa: E402
from fxmega.planning.report import estimate_plan  # noqa: E402

# size, heads, hidden, layers, TP, PP, DP, GPUs, global batch, their TFLOP/s per GPU, MFU
MEGATRON_H100 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]


def config(heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int, batch: int) -> RunConfig:
    return RunConfig(
        name="gpt",
        model=gpt.Config(vocab_size=131072, max_seq_len=4096, d_model=hidden, n_layers=layers, n_heads=heads),
        train=TrainConfig(micro_batch_size=1, global_batch_size=batch, seq_len=4096),
        parallel=ParallelConfig(mesh=f"dp={dp},tp={tp},pp={pp}", zero=1, distributed_optimizer=True,
                                sequence_parallel=tp > 1),
        compute=ComputeConfig(precision="bf16"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated sizes, e.g. 1.7B,7.1B")
    args = parser.parse_args()
    profile = devices.PROFILES["h100"]
    print("| model | params (fxmega GPT) | Megatron TP/PP/DP | fxmega's memory/GPU for it | Megatron MFU "
          "| fxmega's choice | its memory/GPU | its estimated MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, _, mfu in MEGATRON_H100:
        if args.only and size not in args.only.split(","):
            continue
        cfg = config(heads, hidden, layers, tp, pp, dp, batch)
        specs = gpt.param_specs(cfg.model)
        plan = plan_from(specs, cfg.parallel, gpt.FAMILY)  # flat buffers: dp=48 needs not divide the hidden size
        theirs = estimate_plan(cfg, plan).peak
        found = [c for c in auto.search(cfg, gpus, profile) if not c.reason]
        best = found[0] if found else None
        choice = best.describe() if best else "none fits"
        print(f"| {size} | {count_params(specs) / 1e9:.1f}B | {tp}/{pp}/{dp} | {theirs / 1e9:.1f} GB | "
              f"{mfu:.0%} | {choice} | {best.memory / 1e9 if best else 0:.1f} GB | {best.mfu if best else 0:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
