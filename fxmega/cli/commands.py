"""The commands: ``python run.py [COMMAND] --config FILE [flags] [--set key=value ...]``.

Each command's flags are in ``fxmega.cli.parser``; here each command runs, in this process,
on the ranks it starts with torch.distributed.run, or as one rank under a launcher. Errors
that fxmega raises on purpose are printed as one message, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fxmega.cli.launch import check_launch, record_error, start_ranks
from fxmega.cli.parser import config_from_args, flag, parse_args
from fxmega.config import RunConfig, override
from fxmega.core.errors import ConfigError, FxmegaError
from fxmega.core.log import get_logger, set_level
from fxmega.data.tokenizer import build_tokenizer
from fxmega.inference import harness
from fxmega.inference.generation_cli import check_generator, generate_fn, generate_texts, load_generator
from fxmega.inference.model_loader import load_model, recorded, recorded_config, recorded_tokenizer
from fxmega.inference.seq2seq import is_encoder_decoder
from fxmega.inference.serve import STOP_DRAIN_S, serve
from fxmega.inference.serve_mesh import Leader, follow, score_on_mesh
from fxmega.models import family_name, model_for
from fxmega.ops.init import count_params
from fxmega.parallel import distributed
from fxmega.parallel.runtime import Parallel
from fxmega.parallel.strategy import run_plan
from fxmega.planning import auto, devices, visualize
from fxmega.planning.report import parse_bytes, plan_report
from fxmega.planning.summary import summary
from fxmega.sharding.mesh import MeshSpec
from fxmega.storage import checkpoint, convert
from fxmega.storage.checkpoint_files import read_meta
from fxmega.storage.orbax_io import from_orbax, to_orbax
from fxmega.training.checks import resume_optimizer
from fxmega.training.evaluate import evaluate_checkpoint, report
from fxmega.training.finetune import finetune
from fxmega.training.interrupt import Interrupted
from fxmega.training.train import train

log = get_logger(__name__)

# commands that run a checkpoint: with --load alone they take the config it records
FROM_CHECKPOINT = ("eval", "generate", "serve")


def checkpoint_config(args: argparse.Namespace) -> RunConfig:
    """The config to run ``--load``'s checkpoint with: ``--config`` when given (checkpoints
    written before they described themselves need it), else the one the checkpoint records;
    then the flags. The tokenizer is the checkpoint's unless ``--tokenizer`` or ``--set
    data.tokenizer=`` names one."""
    path = flag(args, "--load")
    if not path:
        if args.config:
            return config_from_args(args)  # the command itself says that it needs --load
        raise ConfigError(f"{args.command} needs --load CKPT (a checkpoint records its model and tokenizer), or "
                          f"--config FILE with --load")
    found, meta = recorded(path)
    cfg = config_from_args(args, None if args.config else recorded_config(found, meta))
    if not _tokenizer_chosen(args):
        spec = recorded_tokenizer(found, meta)
        if spec is not None or not args.config:  # an old checkpoint under --config keeps the config's
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec or ""))
    return cfg


def finetune_config(args: argparse.Namespace) -> RunConfig:
    """``--config`` with the flags, whose model (and tokenizer, unless one is chosen) is that
    of the fxmega checkpoint ``--load`` names, when it records one: fine-tuning continues that
    model, so the config gives the training, not the shapes. A Hugging Face directory is read
    later, by the fine-tuning run."""
    cfg = _config(args)
    path = flag(args, "--load")
    found = checkpoint.resolve(path) if path else None
    if found is None:
        return cfg
    meta = read_meta(found)
    if "model" not in (meta.get("config") or {}):  # written before checkpoints described themselves
        return cfg
    cfg = dataclasses.replace(cfg, model=recorded_config(found, meta).model)
    spec = recorded_tokenizer(found, meta)
    if spec is not None and not _tokenizer_chosen(args):
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))
    log.info(f"finetune: the model ({family_name(cfg.model)}) and tokenizer are {found}'s; --config gives the training")
    return cfg.validate(None)


def _tokenizer_chosen(args: argparse.Namespace) -> bool:
    return flag(args, "--tokenizer") is not None or any(
        o.split("=", 1)[0].strip() == "data.tokenizer" for o in args.overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        set_level(args.log_level)
        return RUNNERS[args.command](args, argv)
    except Interrupted as e:  # said already, by the loop that saved
        return e.exit_code
    except FxmegaError as e:
        record_error(e)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C outside a training loop, or a second one inside it
        log.error(str(e) or "interrupted")
        return 128 + signal.SIGINT


def _config(args: argparse.Namespace) -> RunConfig:
    """``--config`` with the flags, validated before any spec or plan is built from it."""
    if not args.config:
        raise ConfigError(f"run.py {args.command} needs --config: a Python config file, e.g. --config "
                          f"configs/tiny_gpt.py")
    if flag(args, "--mesh") == "auto" and args.command != "plan":
        raise ConfigError("--mesh auto chooses a layout and runs nothing: run.py plan --config FILE --mesh auto "
                          "--devices N, then run with the --mesh it ranks first")
    return config_from_args(args).validate(None)


def _asked(args: argparse.Namespace, name: str, key: str) -> bool:
    """Whether this command line sets ``key`` itself: flag ``name`` or ``--set key=...`` (not
    a config file's value, nor a checkpoint's recorded one)."""
    return flag(args, name) is not None or any(o.startswith(f"{key}=") for o in args.overrides)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = resume_optimizer(_config(args), _asked(args, "--optimizer", "optim.optimizer"))
    return _on_mesh(cfg, argv, lambda c, par, dev: train(c, progress=not args.no_progress, parallel=par, device=dev),
                    args.oversubscribe)


def _from_checkpoint(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = checkpoint_config(args).validate(None)
    # the checkpoint records its training run's log: eval writes where this command says, or nowhere
    log_jsonl = cfg.train.log_jsonl if _asked(args, "--log-jsonl", "train.log_jsonl") else ""
    if log_jsonl and not Path(log_jsonl).resolve().parent.is_dir():
        raise ConfigError(f"--log-jsonl {log_jsonl}: its directory does not exist; create it or give another path")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, log_jsonl=log_jsonl))
    if args.command in ("generate", "serve"):
        check_generator(cfg)
    job = {"eval": lambda c, par, dev: _eval(c, par, dev, args),
           "generate": lambda c, par, dev: _generate(c, par, dev, args),
           "serve": lambda c, par, dev: _serve(c, par, dev, args)}[args.command]
    return _on_mesh(cfg, argv, job, args.oversubscribe)


def _summary(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = _config(args)
    cfg.validate()
    print(summary(cfg.model, cfg.train.seq_len))
    return 0


def _convert(args: argparse.Namespace, argv: list[str]) -> int:
    save, load = flag(args, "--save"), flag(args, "--load")
    source = args.from_hf or args.from_orbax
    if source:
        if not save:
            raise ConfigError("convert --from-hf/--from-orbax DIR needs --save CKPT: where to write the checkpoint")
        if args.from_hf:
            family, cfg, params = convert.from_hf(source)
        else:
            family, cfg, params = from_orbax(source)
        spec = flag(args, "--tokenizer") or (convert.tokenizer_spec(source, family) if args.from_hf else None)
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
        found, meta = recorded(load)
        cfg = override(config_from_args(args, None if args.config else recorded_config(found, meta)),
                       ["train.device=cpu"])
        run = load_model(cfg, path=load, with_tokenizer=False, command="convert --to-hf")
        if args.to_hf:
            spec = flag(args, "--tokenizer") or recorded_tokenizer(found, meta) or cfg.data.tokenizer
            eos = build_tokenizer(spec, cfg.data.data_dir).eod if spec else None
            path = convert.to_hf(family_name(cfg.model), cfg.model, run.params, target, eos_id=eos)
            print(f"wrote {path} (config.json, model.safetensors; end-of-document id {eos}): loads with "
                  f"transformers' from_pretrained")
        else:
            path = to_orbax(family_name(cfg.model), cfg.model, run.params, target)
            print(f"wrote {path} (fxmega_model.json, params/): restores with orbax StandardCheckpointer")
        return 0
    raise ConfigError("convert needs --from-hf/--from-orbax DIR --save CKPT, or --load CKPT --to-hf/--to-orbax DIR")


def _plan(args: argparse.Namespace, argv: list[str]) -> int:
    """``plan``: the whole plan for ``--mesh`` in this process (``fxmega.planning.report``);
    ``--explain``, ``--show`` or ``--plan-html`` print (or write) only what they name;
    ``--mesh auto``: the layouts for ``--devices`` devices, ranked."""
    if flag(args, "--mesh") == "auto":
        return _auto(args)
    cfg = _config(args)
    budget = parse_bytes(args.memory_per_device) if args.memory_per_device else None
    model = model_for(cfg.model)
    plan = run_plan(cfg, model)
    if args.explain:
        cfg.validate(plan.mesh.data_size)
        print(plan.explain(), flush=True)
    elif not (args.show or args.plan_html):
        print(plan_report(cfg, budget, args.rank, dump_dir=cfg.train.dump_kernels or None,
                          profile=devices.parse_profile(args.device_profile)), flush=True)
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
    setattr(args, "flag:--mesh", None)  # auto is no mesh to build a config with
    cfg = _config(args)
    profile = devices.parse_profile(args.device_profile)
    budget = parse_bytes(args.memory_per_device) if args.memory_per_device else None
    print(auto.report(cfg, args.devices, profile, budget, config_path=args.config), flush=True)
    return 0


def _eval(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None, args: argparse.Namespace) -> None:
    if args.tasks:
        _harness(cfg, parallel, device, args)
        return
    result = evaluate_checkpoint(cfg, parallel, device)
    if parallel is None or parallel.rank == 0:
        print(report(result), flush=True)
        if cfg.train.log_jsonl:
            with open(cfg.train.log_jsonl, "a") as f:
                f.write(json.dumps(result) + "\n")


def _harness(cfg: RunConfig, parallel: Parallel | None, device: torch.device | None,
             args: argparse.Namespace) -> None:
    """``eval --tasks``: lm-evaluation-harness's tasks on the checkpoint's model (every rank runs
    the harness alike; rank 0 prints its table and writes its results)."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.log_samples and not args.output_path:
        raise ConfigError("--log-samples writes each request and answer into the results JSON: give --output-path FILE")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    manager = harness.task_manager(args.include_path)
    harness.check_tasks(manager, tasks, args.include_path)
    run = load_model(cfg, parallel, device, command="eval --tasks")
    results = harness.evaluate_tasks(run, manager, tasks, limit, args.num_fewshot, cfg.train.micro_batch_size,
                                     args.log_samples)
    if run.main:
        print(harness.report(results), flush=True)
        if args.output_path:
            harness.write_results(results, args.output_path)
            print(f"results written to {args.output_path}", flush=True)


def _finetune(args: argparse.Namespace, argv: list[str]) -> int:
    """Sequence classification (``fxmega.training.finetune``) on one device, or on the mesh's ranks
    (started with torch.distributed.run when not under a launcher already)."""
    cfg = finetune_config(args)
    if not args.data_path:
        raise ConfigError('finetune needs --data-path TRAIN.jsonl (JSON lines of {"text": ..., "label": ...})')
    world = MeshSpec.parse(cfg.parallel.mesh).world_size
    if world > 1 and not distributed.under_launcher():
        check_launch(cfg, model_for(cfg.model), args.oversubscribe)  # the backbone's plan; the classifier is replicated
        return start_ranks(world, argv)
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
        # a decoder continues its prompt; an encoder-decoder's output follows its source
        joint = "\n=> " if is_encoder_decoder(run.model) else ""
        for prompt, text in zip(args.prompt, texts):
            print(f"{prompt}{joint}{text}\n" + "-" * 40, flush=True)


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
    # logprobs are a decoder's token-by-token scores; an encoder-decoder's are not served
    score_fn = None if is_encoder_decoder(run.model) else leader.score if leader is not None else \
        functools.partial(score_on_mesh, run)
    server = serve(leader or generate_fn(run), run.tokenizer, args.host, args.port,
                   max_context=cfg.model.max_seq_len, max_prompt_tokens=cfg.model.max_seq_len - 1,
                   model_name=cfg.name, score_fn=score_fn)
    where = f"mesh {parallel.groups.mesh.describe()}; " if parallel is not None else ""
    log.info(f"serving {cfg.name} on {server.url}/v1/completions and /v1/chat/completions ({where}Ctrl-C stops)")
    # a launcher stops its workers with SIGTERM: stop as on Ctrl-C, so the followers are sent home
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    log.info(f"stopping: no new requests; those in flight get up to {STOP_DRAIN_S:.0f} s to finish "
             f"(a second Ctrl-C stops at once)")
    try:
        unanswered = server.stop(drain_s=STOP_DRAIN_S, cut_s=0.0 if leader is not None else 5.0)
    except KeyboardInterrupt:
        log.error("aborted by a second signal: requests in flight were dropped")
        sys.stdout.flush()
        os._exit(128 + signal.SIGINT)
    if unanswered:
        log.warning(f"{unanswered} request(s) still unanswered at exit")
    if leader is not None:
        leader.close(timeout_s=5.0)  # followers the launcher has not stopped yet go home
    # a generation thread may still be inside torch: the interpreter's teardown would then abort
    # on a joinable C++ thread ("terminate called without an active exception", rc 134)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _on_mesh(cfg: RunConfig, argv: list[str], job: Callable[[RunConfig, Parallel | None, torch.device | None], None],
             oversubscribe: bool) -> int:
    """Run ``job(cfg, parallel, device)`` in this process (one device), on ranks started
    with torch.distributed.run after every check (a mesh larger than 1 outside a launcher:
    ``fxmega.cli.launch``), or as this rank."""
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    if not distributed.under_launcher():
        if mesh.world_size > 1:
            check_launch(cfg, model_for(cfg.model), oversubscribe)
            return start_ranks(mesh.world_size, argv)
        job(cfg, None, None)
        return 0
    try:
        parallel, device = distributed.setup(cfg, mesh)
        job(cfg, parallel, device)
    except Interrupted as e:  # every rank saved the same step; rank 0 said so
        sys.stdout.flush()
        os._exit(e.exit_code)
    except KeyboardInterrupt as e:  # a second signal: at once, without a teardown that could wait
        if int(os.environ.get("RANK", "0")) == 0:
            log.error(str(e) or "interrupted")
        sys.stdout.flush()
        os._exit(128 + signal.SIGINT)
    except FxmegaError as e:
        # the group may be broken (a timed-out collective closes gloo's connections): no
        # barrier, no teardown that could hang; say what happened (once: ``record_error``) and leave
        record_error(e)
        sys.stdout.flush()
        os._exit(2)
    distributed.shutdown()
    # leave without the interpreter's teardown: with the group destroyed, a background C++
    # thread (gloo's, inductor's) could still be joinable when static destructors run, and
    # std::terminate then aborts a rank whose work is done and written ("terminate called
    # without an active exception", seen once in ~50 runs of `generate --mesh tp=2`)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


RUNNERS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "train": _train, "finetune": _finetune, "eval": _from_checkpoint, "generate": _from_checkpoint,
    "serve": _from_checkpoint, "convert": _convert, "plan": _plan, "summary": _summary}
