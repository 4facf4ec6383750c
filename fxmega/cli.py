"""Command line: ``python run.py [train] --config FILE [flags] [--set key=value ...]``.

Flags use Megatron-LM's names where the meaning is the same (``--train-iters``,
``--micro-batch-size``, ``--global-batch-size``, ``--seq-length``, ``--lr``, ...). Each flag
is only a shorthand for a ``--set`` of one config key; ``--set`` comes last and wins.
Errors that fxmega raises on purpose are printed as one message, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from fxmega.config import RunConfig, load, override
from fxmega.core.errors import ConfigError, FxmegaError
from fxmega.inference.generation_cli import generate_fn, generate_texts, load_generator
from fxmega.inference.model_loader import load_model, recorded, recorded_config, recorded_tokenizer
from fxmega.inference.serve import serve
from fxmega.inference.serve_mesh import Leader, follow
from fxmega.models import family_name, model_for
from fxmega.ops.init import count_params
from fxmega.planning import auto
from fxmega.planning.report import parse_bytes, plan_report
from fxmega.planning.summary import summary
from fxmega.sharding import distributed, visualize
from fxmega.sharding.mesh import MeshSpec
from fxmega.sharding.runtime import Parallel
from fxmega.sharding.strategy import plan_from
from fxmega.storage import convert
from fxmega.storage.orbax_io import from_orbax, to_orbax
from fxmega.training.evaluate import evaluate_checkpoint, report
from fxmega.training.finetune import finetune
from fxmega.training.train import train

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
    "--keep-last": "train.keep_last",
    "--on-nonfinite": "train.nonfinite",
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
    "--compile-backend": "train.compile_backend",
    "--dump-kernels": "train.dump_kernels",
    "--precision": "compute.precision",
    "--grad-reduce": "compute.grad_reduce",
    "--loss-scale": "compute.loss_scale",
    "--initial-loss-scale": "compute.initial_loss_scale",
    "--min-loss-scale": "compute.min_loss_scale",
    "--loss-scale-window": "compute.loss_scale_window",
    "--hysteresis": "compute.hysteresis",
    "--recompute": "compute.recompute",
    "--recompute-layers": "compute.recompute_layers",
    "--kernels": "compute.kernels",
    "--loss-chunk": "compute.loss_chunk",
}


# on/off flags (argparse dest) -> the config assignment each one stands for
SWITCHES = {
    "mock_data": "data.source=mock",
    "no_compile": "train.compile=false",
    "sequence_parallel": "parallel.sequence_parallel=true",
    "async_save": "train.async_save=true",
    "deterministic": "train.deterministic=true",
    "finetune": "train.finetune=true",
    "bf16": "compute.precision=bf16",
    "fp16": "compute.precision=fp16",
}


COMMANDS = ["train", "summary", "convert", "eval", "generate", "serve", "finetune"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run.py", description="Train (default) or inspect a model described by a Python config file.")
    parser.add_argument("command", nargs="?", default="train", choices=COMMANDS,
                        help="train (default); eval: loss and perplexity of --load CKPT on the validation split; "
                             "generate: complete --prompt texts with --load CKPT; serve: an HTTP completion server "
                             "(POST /v1/completions); finetune: sequence classification on --data-path "
                             "TRAIN.jsonl ({text, label} lines); summary: print the model summary and exit; "
                             "convert: Hugging Face <-> fxmega checkpoints (--from-hf DIR --save CKPT, or --load "
                             "CKPT --to-hf DIR)")
    parser.add_argument("--config", help="Python config file setting `config = RunConfig(...)`")
    parser.add_argument("--from-hf", metavar="DIR", help="convert: a Hugging Face model directory to import")
    parser.add_argument("--to-hf", metavar="DIR", help="convert: write the --load checkpoint as a Hugging Face model")
    parser.add_argument("--from-orbax", metavar="DIR", help="convert: an orbax export (run.py convert --to-orbax)")
    parser.add_argument("--to-orbax", metavar="DIR", help="convert: write the --load checkpoint as an orbax pytree")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set train.lr=3e-4 (repeatable)")
    parser.add_argument("--summary", action="store_true", help="print the model summary from specs alone and exit")
    parser.add_argument("--mock-data", action="store_true", help="train on deterministic synthetic tokens")
    parser.add_argument("--no-compile", action="store_true", help="run the same step eagerly, without torch.compile")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the residual stream along the sequence over tp (Megatron's sequence parallelism)")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in a background thread")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels: the same seed and mesh give bitwise the same run")
    parser.add_argument("--bf16", action="store_true", help="same as --precision bf16 (Megatron's flag)")
    parser.add_argument("--fp16", action="store_true", help="same as --precision fp16 (Megatron's flag)")
    parser.add_argument("--finetune", action="store_true",
                        help="with --load: take only the parameters; optimizer and step start fresh")
    parser.add_argument("--explain", action="store_true",
                        help="print the sharding plan for --mesh (any size, no processes started) and exit")
    plan = parser.add_argument_group("plan at any scale (one process, no devices)")
    plan.add_argument("--plan", action="store_true",
                      help="print mesh, rank layout, sharding table, stage map, memory per rank and communication per "
                           "axis for --mesh (any size, checked on a fake process group), then exit")
    plan.add_argument("--memory-per-device", metavar="SIZE", help="--plan/--mesh auto: memory budget, e.g. 80GB")
    plan.add_argument("--rank", type=int, help="--plan: also trace this rank's compiled step and list its collectives")
    plan.add_argument("--show", action="append", default=[], metavar="PATH",
                      help="--plan: draw how parameter PATH (e.g. blocks.0.mlp.w_in) is split over the mesh")
    plan.add_argument("--plan-html", metavar="FILE", help="--plan: also write the plan as an HTML page")
    plan.add_argument("--devices", type=int, help="--mesh auto: how many devices to plan for")
    plan.add_argument("--device-profile", default="h100",
                      help="--mesh auto: h100 | h200 | a100, optionally with peak=,memory=,intra=,inter=,per_node=")
    gen = parser.add_argument_group("generate and serve")
    gen.add_argument("--prompt", action="append", default=[], help="generate: a prompt (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with this mass")
    gen.add_argument("--stop", action="append", default=[], help="a string that ends a completion (repeatable)")
    gen.add_argument("--host", default="127.0.0.1", help="serve: the address to listen on")
    gen.add_argument("--port", type=int, default=8000, help="serve: the port (0: any free one)")
    tune = parser.add_argument_group("finetune")
    tune.add_argument("--valid-path", help="finetune: validation jsonl (default: a held-out fraction of the data)")
    tune.add_argument("--num-classes", type=int, help="finetune: number of classes (default: from the labels)")
    parser.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                        help="sets data.source: a text file, an indexed-dataset prefix, or a blend 0.7 A 0.3 B")
    for flag, key in FLAG_KEYS.items():
        parser.add_argument(flag, dest=f"flag:{flag}", metavar=key.split(".")[1].upper(), help=f"sets {key}")
    return parser


# commands that run a checkpoint: with --load alone they take the config it records
FROM_CHECKPOINT = ("eval", "generate", "serve")


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """``--config`` (or ``base``) with every flag and ``--set`` applied."""
    cfg = load(args.config) if base is None else base
    assignments = [f"{key}={value}" for flag, key in FLAG_KEYS.items()
                   if (value := getattr(args, f"flag:{flag}")) is not None]
    if args.data_path:
        assignments.append(f"data.source={' '.join(args.data_path)}")
    assignments += [assignment for switch, assignment in SWITCHES.items() if getattr(args, switch)]
    return override(cfg, assignments + args.overrides)


def checkpoint_config(args: argparse.Namespace) -> RunConfig:
    """The config to run ``--load``'s checkpoint with: ``--config`` when given (checkpoints
    written before they described themselves need it), else the one the checkpoint records;
    then the flags. The tokenizer is the checkpoint's unless ``--tokenizer`` or ``--set
    data.tokenizer=`` names one."""
    path = getattr(args, "flag:--load")
    if not path:
        if args.config:
            return config_from_args(args)  # the command itself says that it needs --load
        raise ConfigError(f"{args.command} needs --load CKPT (a checkpoint records its model and tokenizer), or "
                          f"--config FILE with --load")
    found, meta = recorded(path)
    cfg = config_from_args(args, None if args.config else recorded_config(found, meta))
    chosen = getattr(args, "flag:--tokenizer") is not None or any(
        o.split("=", 1)[0].strip() == "data.tokenizer" for o in args.overrides)
    if not chosen:
        spec = recorded_tokenizer(found, meta)
        if spec is not None or not args.config:  # an old checkpoint under --config keeps the config's
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec or ""))
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            return _convert(args)
        if args.command in FROM_CHECKPOINT:
            cfg = checkpoint_config(args).validate(None)
            job = {"eval": _eval, "generate": lambda c, par, dev: _generate(c, par, dev, args),
                   "serve": lambda c, par, dev: _serve(c, par, dev, args)}[args.command]
            return _on_mesh(cfg, argv, job)
        if not args.config:
            raise ConfigError("--config is required: a Python config file, e.g. --config configs/tiny_gpt.py")
        if getattr(args, "flag:--mesh") == "auto":
            return _auto(args)
        cfg = config_from_args(args).validate(None)  # before any spec or plan is built from it
        if args.summary or args.command == "summary":

            cfg.validate()
            print(summary(cfg.model, cfg.train.seq_len))
            return 0
        if args.plan or args.show or args.plan_html:
            return _plan(cfg, args)
        if args.explain:

            model = model_for(cfg.model)
            plan = plan_from(model.param_specs(cfg.model), cfg.parallel, model)
            cfg.validate(plan.mesh.data_size)
            print(plan.explain())
            return 0
        if args.command == "finetune":
            return _finetune(cfg, args, argv)
        return _on_mesh(cfg, argv, lambda c, par, dev: _train_job(c, par, dev, not args.no_progress))
    except FxmegaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _convert(args: argparse.Namespace) -> int:

    save, load = getattr(args, "flag:--save"), getattr(args, "flag:--load")
    source = args.from_hf or args.from_orbax
    if source:
        if not save:
            raise ConfigError("convert --from-hf/--from-orbax DIR needs --save CKPT: where to write the checkpoint")
        if args.from_hf:
            family, cfg, params = convert.from_hf(source)
        else:

            family, cfg, params = from_orbax(source)
        spec = getattr(args, "flag:--tokenizer") or (convert.tokenizer_spec(source, family) if args.from_hf else None)
        path = convert.save_params(save, family, cfg, params, str(source), spec)
        print(f"wrote {path}: {family}, {count_params(model_for(cfg).param_specs(cfg)):,} parameters, tokenizer "
              f"{spec or 'none (give --tokenizer SPEC to record one)'}; generate from it with --load {save} alone, "
              f"or train from it with a config whose model is:\n  {cfg!r}")
        return 0
    target = args.to_hf or args.to_orbax
    if target:
        if not load:
            raise ConfigError("convert --to-hf/--to-orbax DIR needs --load CKPT (and, for a checkpoint written before "
                              "checkpoints described themselves, the --config it was trained with)")
        cfg = override(config_from_args(args, None if args.config else recorded_config(*recorded(load))),
                       ["train.device=cpu"])
        run = load_model(cfg, path=load, with_tokenizer=False, command="convert --to-hf")
        if args.to_hf:
            path = convert.to_hf(family_name(cfg.model), cfg.model, run.params, target)
            print(f"wrote {path} (config.json, model.safetensors): loads with transformers' from_pretrained")
        else:

            path = to_orbax(family_name(cfg.model), cfg.model, run.params, target)
            print(f"wrote {path} (fxmega_model.json, params/): restores with orbax StandardCheckpointer")
        return 0
    raise ConfigError("convert needs --from-hf/--from-orbax DIR --save CKPT, or --load CKPT --to-hf/--to-orbax DIR")


def _plan(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``--plan``: the whole plan for ``--mesh`` in this process (``fxmega.planning.report``)."""

    budget = parse_bytes(args.memory_per_device) if args.memory_per_device else None
    if args.plan:
        print(plan_report(cfg, budget, args.rank, dump_dir=cfg.train.dump_kernels or None), flush=True)
    if args.show or args.plan_html:

        model = model_for(cfg.model)
        plan = plan_from(model.param_specs(cfg.model), cfg.parallel, model)
        for path in args.show:
            print(visualize.show_param(plan, path, color=sys.stdout.isatty()), flush=True)
        if args.plan_html:
            visualize.write_plan_html(plan, args.plan_html, title=f"{cfg.name} on {plan.mesh.describe()}")
            print(f"wrote {args.plan_html}", flush=True)
    return 0


def _auto(args: argparse.Namespace) -> int:
    """``--mesh auto``: rank the layouts for ``--devices`` devices (``fxmega.planning.auto``)."""

    if args.devices is None:
        raise ConfigError("--mesh auto needs --devices N: how many devices to plan for")
    setattr(args, "flag:--mesh", None)
    cfg = config_from_args(args).validate(None)
    profile = auto.parse_profile(args.device_profile)
    budget = parse_bytes(args.memory_per_device) if args.memory_per_device else None
    print(auto.report(cfg, args.devices, profile, budget, config_path=args.config), flush=True)
    return 0


def _train_job(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None, progress: bool) -> None:

    train(cfg, progress=progress, parallel=parallel, device=device)


def _eval(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None) -> None:
    import json


    result = evaluate_checkpoint(cfg, parallel, device)
    if parallel is None or parallel.rank == 0:
        print(report(result), flush=True)
        if cfg.train.log_jsonl:
            with open(cfg.train.log_jsonl, "a") as f:
                f.write(json.dumps(result) + "\n")


def _finetune(cfg: RunConfig, args: argparse.Namespace, argv: list[str]) -> int:
    """Sequence classification (``fxmega.training.finetune``) on one device, or on the mesh's ranks
    (started with torch.distributed.run when not under a launcher already)."""

    if not args.data_path:
        raise ConfigError('finetune needs --data-path TRAIN.jsonl (JSON lines of {"text": ..., "label": ...})')
    world = MeshSpec.parse(cfg.parallel.mesh).world_size
    if world > 1 and not distributed.under_launcher():
        return distributed.relaunch(world, argv)
    result = finetune(cfg, args.data_path[0], valid_path=args.valid_path, n_classes=args.num_classes)
    if world > 1 and int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(f"finetune: valid loss {result['valid_loss']:.4f}, valid accuracy {result['valid_accuracy']:.3f} "
          f"over labels {result['labels']}", flush=True)
    return 0


def _generate(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None, args: argparse.Namespace) -> None:

    if not args.prompt:
        raise ConfigError("generate needs at least one --prompt TEXT")
    run = load_generator(cfg, parallel, device)
    texts = generate_texts(run, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.stop, cfg.train.seed)
    if parallel is None or parallel.rank == 0:
        for prompt, text in zip(args.prompt, texts):
            print(f"{prompt}{text}\n" + "-" * 40, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _serve(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None, args: argparse.Namespace) -> None:
    """An HTTP completion server on one device, or on a mesh: rank 0 answers HTTP and the
    other ranks follow its requests (``fxmega.inference.serve_mesh``)."""
    run = load_generator(cfg, parallel, device)
    if parallel is not None and parallel.rank != 0:
        # a follower waits inside a collective, where no Python signal handler runs: let the
        # launcher's SIGTERM or a terminal's Ctrl-C end it at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        follow(run)
        sys.stdout.flush()
        os._exit(0)  # no teardown barrier: rank 0 may be gone already
    leader = Leader(run, cfg.parallel.timeout_s / 4) if parallel is not None else None
    server = serve(leader or generate_fn(run), run.tokenizer, args.host, args.port,
                   max_context=cfg.model.max_seq_len, max_prompt_tokens=cfg.model.max_seq_len - 1,
                   model_name=cfg.name)
    where = f"mesh {parallel.groups.mesh.describe()}; " if parallel is not None else ""
    print(f"serving {cfg.name} on {server.url}/v1/completions ({where}Ctrl-C stops)", flush=True)
    # a launcher stops its workers with SIGTERM: stop as on Ctrl-C, so the followers are sent home
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    if leader is not None:
        leader.close(timeout_s=5.0)  # followers the launcher has not stopped yet go home
        sys.stdout.flush()
        os._exit(0)


def _on_mesh(cfg: RunConfig, argv: list[str],
             job: Callable[[RunConfig, Parallel | None, torch.device | None], None]) -> int:
    """Run ``job(cfg, parallel, device)`` in this process (one device), on ranks started
    with torch.distributed.run (a mesh larger than 1 outside a launcher), or as this rank."""
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    if not distributed.under_launcher():
        if mesh.world_size > 1:
            return distributed.relaunch(mesh.world_size, argv)
        job(cfg, None, None)
        return 0
    parallel, device = distributed.setup(cfg, mesh)
    try:
        job(cfg, parallel, device)
    except FxmegaError as e:
        # the group may be broken (a timed-out collective closes gloo's connections): no
        # barrier, no teardown that could hang; say what happened and leave
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    distributed.shutdown()
    return 0
