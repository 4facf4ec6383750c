"""Command line: ``python run.py [train] --config FILE [flags] [--set key=value ...]``.

Flags use Megatron-LM's names where the meaning is the same (``--train-iters``,
``--micro-batch-size``, ``--global-batch-size``, ``--seq-length``, ``--lr``, ...). Each flag
is only a shorthand for a ``--set`` of one config key; ``--set`` comes last and wins.
Errors that fxmega raises on purpose are printed as one message, not a traceback.
"""

from __future__ import annotations

import argparse
import sys

from fxmega.config import RunConfig, load, override
from fxmega.errors import FxmegaError

# flag -> config key it sets
FLAG_KEYS = {
    "--steps": "train.steps",
    "--train-iters": "train.steps",
    "--seed": "train.seed",
    "--micro-batch-size": "train.micro_batch_size",
    "--global-batch-size": "train.global_batch_size",
    "--seq-length": "train.seq_len",
    "--eval-interval": "train.eval_interval",
    "--eval-iters": "train.eval_iters",
    "--log-interval": "train.log_interval",
    "--log-jsonl": "train.log_jsonl",
    "--tensorboard-dir": "train.tensorboard_dir",
    "--save": "train.save_dir",
    "--save-interval": "train.save_interval",
    "--load": "train.load_dir",
    "--device": "train.device",
    "--sample-tokens": "train.sample_tokens",
    "--lr": "optim.lr",
    "--min-lr": "optim.min_lr",
    "--lr-decay-style": "optim.schedule",
    "--lr-warmup-iters": "optim.warmup_steps",
    "--lr-decay-iters": "optim.decay_steps",
    "--weight-decay": "optim.weight_decay",
    "--clip-grad": "optim.clip_grad",
    "--adam-beta1": "optim.beta1",
    "--adam-beta2": "optim.beta2",
    "--adam-eps": "optim.eps",
    "--split": "data.split",
    "--tokenizer": "data.tokenizer",
    "--data-cache-path": "data.cache_dir",
    "--mesh": "parallel.mesh",
    "--rules": "parallel.rules",
    "--zero": "parallel.zero",
    "--ddp-bucket-size": "parallel.bucket_size",
    "--pipeline-schedule": "parallel.pipeline_schedule",
    "--virtual-stages": "parallel.virtual_stages",
    "--pipeline-layout": "parallel.pipeline_layout",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run.py", description="Train (default) or inspect a model described by a Python config file.")
    parser.add_argument("command", nargs="?", default="train", choices=["train", "summary"],
                        help="train (default), or summary: print the model summary and exit")
    parser.add_argument("--config", required=True, help="Python config file setting `config = RunConfig(...)`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--summary", action="store_true", help="print the model summary from specs alone and exit")
    parser.add_argument("--mock-data", action="store_true", help="train on deterministic synthetic tokens")
    parser.add_argument("--no-compile", action="store_true", help="run the same step eagerly, without torch.compile")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the residual stream along the sequence over tp (Megatron's sequence parallelism)")
    parser.add_argument("--explain", action="store_true",
                        help="print the sharding plan for --mesh (any size, no processes started) and exit")
    parser.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                        help="sets data.source: a text file, an indexed-dataset prefix, or a blend 0.7 A 0.3 B")
    for flag, key in FLAG_KEYS.items():
        parser.add_argument(flag, dest=f"flag:{flag}", metavar=key.split(".")[1].upper(), help=f"sets {key}")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = load(args.config)
    assignments = [f"{key}={value}" for flag, key in FLAG_KEYS.items()
                   if (value := getattr(args, f"flag:{flag}")) is not None]
    if args.data_path:
        assignments.append(f"data.source={' '.join(args.data_path)}")
    if args.mock_data:
        assignments.append("data.source=mock")
    if args.no_compile:
        assignments.append("train.compile=false")
    if args.sequence_parallel:
        assignments.append("parallel.sequence_parallel=true")
    return override(cfg, assignments + args.overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.summary or args.command == "summary":
            from fxmega.summary import summary

            cfg.validate()
            print(summary(cfg.model, cfg.train.seq_len))
            return 0
        if args.explain:
            from fxmega.models import model_for
            from fxmega.sharding.strategy import plan_from

            model = model_for(cfg.model)
            plan = plan_from(model.param_specs(cfg.model), cfg.parallel, model)
            cfg.validate(plan.mesh.data_size)
            print(plan.explain())
            return 0
        return _train(cfg, argv, progress=not args.no_progress)
    except FxmegaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _train(cfg: RunConfig, argv: list[str], progress: bool) -> int:
    from fxmega.sharding import distributed
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.train import train

    mesh = MeshSpec.parse(cfg.parallel.mesh)
    if not distributed.under_launcher():
        if mesh.world_size > 1:
            return distributed.relaunch(mesh.world_size, argv)
        train(cfg, progress=progress)
        return 0
    parallel, device = distributed.setup(cfg, mesh)
    try:
        train(cfg, progress=progress, parallel=parallel, device=device)
    finally:
        distributed.shutdown()
    return 0
