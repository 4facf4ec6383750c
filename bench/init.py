#!/usr/bin/env python3
"""Sharded init: time and host memory for one rank's parameters, Llama-2-7B on a fake 8x4x2
mesh (dp=8, tp=4, pp=2; rank 0: the first pipeline stage, a quarter of each tp-split
tensor), each method in a fresh process (a resident-set high-water mark only grows):

  full tensor, then slice   what fxmega did before: every parameter of the rank's stage drawn
                            whole on the host (torch.randn, one generator per parameter),
                            padded and sliced to the rank's shard
  shard only (fxmega)       ``ParamShards.init_params``: each shard drawn by position
                            (``fxmega.ops.counter_random``) on the rank's device; no full
                            tensor exists

"peak host MiB" is the resident-set high-water mark above what the process held before init.

    python bench/init.py [--config configs/llama2_7b.py --mesh 8x4x2 --rank 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxmega.config import load, override  # noqa: E402
from fxmega.core import tree  # noqa: E402
from fxmega.ops.init import param_seed  # noqa: E402
from fxmega.planning.fake import fake_parallel, fake_world  # noqa: E402
from fxmega.sharding.mesh import MeshSpec  # noqa: E402

METHODS = ("full tensor, then slice", "shard only (fxmega)")


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(args: argparse.Namespace) -> dict:
    cfg = override(load(ROOT / args.config), [f"parallel.mesh={args.mesh}", "train.device=cpu"])
    world = MeshSpec.parse(args.mesh).world_size
    with fake_world(world, args.rank):
        par = fake_parallel(cfg, args.rank)
        seed, before = cfg.train.seed, rss_peak_mib()
        t0 = time.perf_counter()
        if args.method == METHODS[0]:
            params = {}
            for path, spec in tree.items(par.specs):
                if spec.init.kind in ("zeros", "ones"):
                    full = torch.zeros(spec.shape) if spec.init.kind == "zeros" else torch.ones(spec.shape)
                else:
                    gen = torch.Generator().manual_seed(param_seed(seed, path))
                    full = torch.randn(spec.shape, generator=gen) * spec.init.std
                params[path] = par.shards.local_of(full, path)
                del full
        else:
            params = dict(tree.items(par.shards.init_params(seed, torch.device("cpu"))))
        seconds = time.perf_counter() - t0
        held = sum(t.numel() * t.element_size() for t in params.values()) / 2**20
        full_numel = sum(spec.numel for _, spec in tree.items(par.specs))
    return {"seconds": seconds, "peak_mib": rss_peak_mib() - before, "held_mib": held,
            "local_params": sum(t.numel() for t in params.values()), "stage_params": full_numel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama2_7b.py")
    ap.add_argument("--mesh", default="8x4x2")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--method", choices=METHODS, help="(internal) measure one method in this process")
    args = ap.parse_args()
    if args.method:
        print(json.dumps(measure(args)))
        return
    print(f"{args.config}, mesh {args.mesh}, rank {args.rank}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU")
    print(f"{'method':<26}{'seconds':>10}{'peak host MiB':>15}{'shard MiB':>11}{'values drawn':>15}")
    for method in METHODS:
        out = subprocess.run([sys.executable, __file__, "--config", args.config, "--mesh", args.mesh, "--rank",
                              str(args.rank), "--method", method], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        drawn = r["stage_params"] if method == METHODS[0] else r["local_params"]
        print(f"{method:<26}{r['seconds']:>10.1f}{r['peak_mib']:>15,.0f}{r['held_mib']:>11,.0f}{drawn:>15,}")


if __name__ == "__main__":
    main()
