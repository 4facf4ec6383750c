"""One parser per command: ``run.py COMMAND --help`` lists that command's flags only, grouped
as Megatron-LM groups its arguments, and a flag given to the wrong command is an error that
names the commands it belongs to.

Flags keep Megatron-LM's names where the meaning is the same (``--train-iters``,
``--micro-batch-size``, ``--global-batch-size``, ``--seq-length``, ``--lr``, ...). A flag
that stands for a config key is only a shorthand for ``--set`` of that key (``--set`` comes
last and wins); the others (``--prompt``, ``--port``, ...) are read by their command.

argparse rather than tyro (torchtitan's choice): tyro derives flags from the dataclass
fields (``--optim.lr``), while our flags are Megatron's names for nested keys, so every flag
would still need an alias; argparse gives per-command parsers, groups and help with no
dependency, and ``--set`` already reaches every config field.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Protocol

from fxmega.config import RunConfig, load, override
from fxmega.core.errors import ConfigError
from fxmega.core.log import LEVELS


class _TakesArguments(Protocol):  # a parser or one of its argument groups
    def add_argument(self, *names: str, **options: object) -> object: ...


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag. ``key``: the config key it sets (a value flag), or with
    ``switch`` the assignment an on/off flag stands for; neither: its command reads it."""

    name: str
    help: str = ""
    key: str = ""
    switch: str = ""
    options: dict = dataclasses.field(default_factory=dict)  # argparse options of a command's own flag

    @property
    def dest(self) -> str:
        if self.key:
            return f"flag:{self.name}"
        return self.options.get("dest") or self.name.lstrip("-").replace("-", "_")

    def add_to(self, group: _TakesArguments) -> None:
        if self.key:
            group.add_argument(self.name, dest=self.dest, metavar=self.key.split(".")[1].upper(),
                               help=self.help or f"sets {self.key}")
        elif self.switch:
            group.add_argument(self.name, dest=self.dest, action="store_true",
                               help=f"{self.help} (sets {self.switch})" if self.help else f"sets {self.switch}")
        else:
            group.add_argument(self.name, help=self.help, **{"dest": self.dest, **self.options})


def _keys(pairs: str) -> list[Flag]:
    """``"--flag key --flag key ..."`` as value flags."""
    words = pairs.split()
    return [Flag(name, key=key) for name, key in zip(words[::2], words[1::2])]


# Megatron's argument groups, by title; each command takes whole groups or some of their flags
GROUPS: dict[str, list[Flag]] = {
    "config": [
        Flag("--config", "Python config file setting `config = RunConfig(...)`", options={"metavar": "FILE"}),
        Flag("--set", "override any config key, e.g. --set optim.lr=3e-4 (repeatable; applied last)",
             options={"dest": "overrides", "action": "append", "default": [], "metavar": "KEY=VALUE"}),
    ],
    "training": [
        *_keys("--train-iters train.steps --steps train.steps --micro-batch-size train.micro_batch_size "
               "--global-batch-size train.global_batch_size --seed train.seed --device train.device "
               "--compile-backend train.compile_backend --dump-kernels train.dump_kernels "
               "--on-nonfinite train.nonfinite --sample-tokens train.sample_tokens --recompute compute.recompute "
               "--recompute-layers compute.recompute_layers --kernels compute.kernels --loss-chunk compute.loss_chunk"),
        Flag("--no-compile", "run the same step eagerly, without torch.compile", switch="train.compile=false"),
        Flag("--deterministic", "deterministic kernels: the same seed and mesh give bitwise the same run",
             switch="train.deterministic=true"),
    ],
    "learning rate": _keys("--optimizer optim.optimizer --lr optim.lr --min-lr optim.min_lr "
                           "--lr-decay-style optim.schedule "
                           "--lr-warmup-iters optim.warmup_steps --lr-decay-iters optim.decay_steps "
                           "--weight-decay optim.weight_decay --clip-grad optim.clip_grad --adam-beta1 optim.beta1 "
                           "--adam-beta2 optim.beta2 --adam-eps optim.eps"),
    "checkpointing": [
        *_keys("--save train.save_dir --save-interval train.save_interval --load train.load_dir "
               "--keep-last train.keep_last"),
        Flag("--async-save", "write checkpoints in a background thread", switch="train.async_save=true"),
        Flag("--finetune", "with --load: take only the parameters; optimizer and step start fresh",
             switch="train.finetune=true"),
    ],
    "mixed precision": [
        *_keys("--precision compute.precision --grad-reduce compute.grad_reduce --loss-scale compute.loss_scale "
               "--initial-loss-scale compute.initial_loss_scale --min-loss-scale compute.min_loss_scale "
               "--loss-scale-window compute.loss_scale_window --hysteresis compute.hysteresis"),
        Flag("--bf16", "same as --precision bf16 (Megatron's flag)", switch="compute.precision=bf16"),
        Flag("--fp16", "same as --precision fp16 (Megatron's flag)", switch="compute.precision=fp16"),
        Flag("--fp8", key="compute.fp8", help="sets compute.fp8: tensorwise or rowwise scaled fp8 for the dense "
             "layers' weight matmuls, through torchao (pip install 'fxmega[fp8]'); off by default"),
        Flag("--fp8-gather", "with --fp8 tensorwise under ZeRO-3/fsdp: all-gather those weights in fp8 with their "
             "scales (half of bf16's gather bytes)", switch="compute.fp8_gather=true"),
    ],
    "distributed": [
        Flag("--mesh", key="parallel.mesh",
             help="sets parallel.mesh: the device mesh, e.g. 8x4x2 (dp x tp x pp) or dp=2,tp=2"),
        *_keys("--rules parallel.rules --zero parallel.zero --ddp-bucket-size parallel.bucket_size "
               "--pipeline-schedule parallel.pipeline_schedule --virtual-stages parallel.virtual_stages "
               "--pipeline-layout parallel.pipeline_layout --cp-attention parallel.cp_attention"),
        Flag("--sequence-parallel", "split the residual stream along the sequence over tp (Megatron's sequence "
             "parallelism)", switch="parallel.sequence_parallel=true"),
        Flag("--use-distributed-optimizer", "ZeRO-1/2 over flat buffers, each data rank a contiguous range (any "
             "data size shards any model; Megatron's flag)", switch="parallel.distributed_optimizer=true"),
        Flag("--overlap-comm", "let inductor issue each collective as soon as its inputs exist and wait only where "
             "its result is used (Megatron's --overlap-grad-reduce and --overlap-param-gather)",
             switch="parallel.overlap_comm=true"),
        Flag("--overlap-param-gather", "ZeRO-1/2: all-gather the updated shards at the start of the next step, "
             "each bucket waited for just before the layers that read it (needs --overlap-comm; Megatron's flag)",
             switch="parallel.overlap_param_gather=true"),
        Flag("--tp-comm-overlap", "split tensor-parallel matmuls so sequence parallelism's all-gathers and "
             "reduce-scatters overlap them (torch's async TP; CUDA only; Megatron's flag)",
             switch="parallel.async_tp=true"),
    ],
    "launching": [
        Flag("--oversubscribe", "start the mesh's local ranks even where this machine's GPUs, cores or memory "
             "cannot hold them (refused otherwise, before any starts)", options={"action": "store_true"}),
    ],
    "validation": _keys("--eval-interval train.eval_interval --eval-iters train.eval_iters"),
    "data": [
        Flag("--data-path", "sets data.source: a text file, an indexed-dataset prefix, or a blend 0.7 A 0.3 B",
             options={"nargs": "+", "metavar": "[WEIGHT] PREFIX"}),
        *_keys("--seq-length train.seq_len --split data.split --tokenizer data.tokenizer "
               "--data-cache-path data.cache_dir"),
        Flag("--mock-data", "train on deterministic synthetic tokens", switch="data.source=mock"),
    ],
    "logging": [
        *_keys("--log-interval train.log_interval --log-jsonl train.log_jsonl --tensorboard-dir train.tensorboard_dir"),
        Flag("--log-level", "messages at this level and above: rank 0's, and every rank's warnings and errors "
             "(debug: every rank's)", options={"choices": list(LEVELS), "default": "info"}),
        Flag("--no-progress", "no progress bar (log lines only)", options={"action": "store_true"}),
    ],
    "fine-tuning": [
        Flag("--valid-path", "validation jsonl (default: a held-out fraction of the data)"),
        Flag("--num-classes", "number of classes (default: from the labels)", options={"type": int}),
    ],
    "generation": [
        Flag("--prompt", "a prompt (repeat for a batch)", options={"action": "append", "default": []}),
        Flag("--max-new-tokens", "tokens to generate per prompt (default: 64, or as many as the model's "
             "context leaves after the longest prompt)", options={"type": int, "default": None}),
        Flag("--temperature", "0: greedy", options={"type": float, "default": 0.8}),
        Flag("--top-k", "sample among the k most likely tokens (0: all)", options={"type": int, "default": 0}),
        Flag("--top-p", "nucleus sampling: the smallest set with this mass", options={"type": float, "default": 1.0}),
        Flag("--stop", "a string that ends a completion (repeatable)", options={"action": "append", "default": []}),
    ],
    "lm-evaluation-harness": [
        Flag("--tasks", "run these lm-evaluation-harness tasks or groups (comma-separated) instead of the "
             "validation loss", options={"metavar": "T1,T2"}),
        Flag("--include-path", "a folder of task YAML files to add to the harness's tasks", options={"metavar": "DIR"}),
        Flag("--limit", "at most this many examples per task (a fraction below 1: that share)",
             options={"type": float}),
        Flag("--num-fewshot", "few-shot examples per prompt (default: each task's own)", options={"type": int}),
        Flag("--output-path", "also write the harness's results as JSON", options={"metavar": "FILE"}),
        Flag("--log-samples", "with --output-path: every request and the model's answer in the JSON too",
             options={"action": "store_true"}),
    ],
    "serving": [
        Flag("--host", "the address to listen on", options={"default": "127.0.0.1"}),
        Flag("--port", "the port (0: any free one)", options={"type": int, "default": 8000}),
    ],
    "conversion": [
        Flag("--from-hf", "a Hugging Face model directory to import (with --save CKPT)", options={"metavar": "DIR"}),
        Flag("--to-hf", "write the --load checkpoint as a Hugging Face model", options={"metavar": "DIR"}),
        Flag("--from-orbax", "an orbax export (run.py convert --to-orbax) to import", options={"metavar": "DIR"}),
        Flag("--to-orbax", "write the --load checkpoint as an orbax pytree", options={"metavar": "DIR"}),
    ],
    "planning": [
        Flag("--explain", "print only the sharding table (and the stage map)", options={"action": "store_true"}),
        Flag("--memory-per-device", "memory budget per device, e.g. 80GB", options={"metavar": "SIZE"}),
        Flag("--rank", "also trace this rank's compiled step and list its collectives", options={"type": int}),
        Flag("--show", "draw how parameter PATH (e.g. blocks.0.mlp.w_in) is split over the mesh",
             options={"action": "append", "default": [], "metavar": "PATH"}),
        Flag("--plan-html", "also write the plan as an HTML page", options={"metavar": "FILE"}),
        Flag("--devices", "--mesh auto: how many devices to plan for", options={"type": int}),
        Flag("--device-profile", "the device --mesh auto prices layouts for, and --rank R replays its "
             "collectives at: h100 | h200 | a100, optionally with peak=,memory=,intra=,inter=,per_node=",
             options={"default": "h100"}),
    ],
}

# the flags of a run that only reads a model: no optimizer, no gradient reductions, no
# checkpoint writing (evaluation still shards its batches: sequence and context parallelism)
_READ = {"training": "--seed --device --no-compile --compile-backend --kernels --deterministic",
         "checkpointing": "--load", "mixed precision": "--precision --bf16 --fp16",
         "distributed": "--mesh --rules --pipeline-layout --virtual-stages --sequence-parallel --cp-attention",
         "launching": "*", "logging": "--log-level"}
# generating decodes one token at a time from a prompt: no batches to split, no data to read
_GENERATE = {**_READ, "distributed": "--mesh --rules --pipeline-layout --virtual-stages", "data": "--tokenizer"}
TRAINING = ("training", "learning rate", "checkpointing", "mixed precision", "distributed", "launching", "validation",
            "data",
            "logging")


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    groups: dict[str, str]  # group title -> "*" (all its flags) or the names of the ones taken


COMMANDS: dict[str, Command] = {
    "train": Command("pre-train (the default command)", {g: "*" for g in TRAINING}),
    "finetune": Command("sequence classification on --data-path TRAIN.jsonl ({text, label} lines)",
                        {**{g: "*" for g in TRAINING}, "fine-tuning": "*"}),
    "eval": Command("loss and perplexity of --load CKPT on the validation split, or lm-evaluation-harness "
                    "--tasks", {**_READ, "training": _READ["training"] + " --micro-batch-size --global-batch-size "
                                "--loss-chunk", "validation": "--eval-iters", "data": "*",
                                "logging": "--log-level --log-jsonl", "lm-evaluation-harness": "*"}),
    "generate": Command("complete --prompt texts with --load CKPT", {**_GENERATE, "generation": "*"}),
    # a request names its own max_tokens, temperature, top_p and stop: serve takes none as flags
    "serve": Command("an HTTP completion server for --load CKPT (POST /v1/completions)",
                     {**_GENERATE, "serving": "*"}),
    "convert": Command("Hugging Face or orbax <-> fxmega checkpoints (--from-hf DIR --save CKPT, or --load CKPT "
                       "--to-hf DIR)", {"conversion": "*", "checkpointing": "--save --load", "data": "--tokenizer",
                                        "logging": "--log-level"}),
    "plan": Command("the plan for --mesh, any size, in one process: rank layout, sharding, stages, memory and "
                    "communication per rank; --mesh auto ranks the layouts for --devices N",
                    {"training": "--micro-batch-size --global-batch-size --recompute --recompute-layers --kernels "
                                 "--loss-chunk --dump-kernels --compile-backend",
                     "mixed precision": "*", "distributed": "*", "data": "--seq-length", "planning": "*",
                     # the optimizer's state is in the memory tables, Muon's gathers in the traffic
                     "learning rate": "--optimizer", "logging": "--log-level"}),
    "summary": Command("the model summary from its specs alone (layers, shapes, parameter counts)",
                       {"data": "--seq-length", "logging": "--log-level"}),
}
DEFAULT_COMMAND = "train"
# flags that became commands
BECAME_COMMANDS = {"--plan": "plan", "--summary": "summary"}


def _flags_of(command: str) -> dict[str, list[Flag]]:
    out = {"config": GROUPS["config"]}
    for title, taken in COMMANDS[command].groups.items():
        names = None if taken == "*" else set(taken.split())
        flags = [f for f in GROUPS[title] if names is None or f.name in names]
        if names is not None and len(flags) != len(names):
            raise AssertionError(f"{command}: {sorted(names - {f.name for f in flags})} are not in group {title}")
        out[title] = flags
    return out


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command, its flags in Megatron's groups."""
    parser = argparse.ArgumentParser(prog=f"run.py {command}", description=COMMANDS[command].help,
                                     usage=f"run.py {command} [flags below] [--set KEY=VALUE ...]",
                                     allow_abbrev=False)
    for title, flags in _flags_of(command).items():
        group = parser.add_argument_group(title)
        for flag in flags:
            flag.add_to(group)
    return parser


def owners(flag: str) -> list[str]:
    """The commands that take ``flag``."""
    return [c for c in COMMANDS if any(f.name == flag for fs in _flags_of(c).values() for f in fs)]


def overview() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: run.py [COMMAND] --config FILE [flags] [--set KEY=VALUE ...]", "",
             f"commands (default: {DEFAULT_COMMAND}; run.py COMMAND --help lists its flags):"]
    lines += [f"  {name:<{width}}  {c.help}" for name, c in COMMANDS.items()]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``[COMMAND] flags...`` -> the command's namespace, ``args.command`` set. A flag that
    belongs to other commands is refused naming them; argparse's own errors exit with 2."""
    if argv and argv[0] in ("-h", "--help"):
        print(overview())
        raise SystemExit(0)
    command, rest = (argv[0], argv[1:]) if argv and argv[0] in COMMANDS else (DEFAULT_COMMAND, argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        raise ConfigError(f"unknown command {argv[0]!r}: one of {', '.join(COMMANDS)}")
    parser = command_parser(command)
    args, unknown = parser.parse_known_args(rest)
    for word in unknown:
        flag = word.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag in BECAME_COMMANDS:
            raise ConfigError(f"{flag} is a command now: run.py {BECAME_COMMANDS[flag]} --config FILE ... "
                              f"(see run.py {BECAME_COMMANDS[flag]} --help)")
        elsewhere = owners(flag)
        if elsewhere:
            raise ConfigError(f"{flag} is not a flag of `run.py {command}`: it belongs to "
                              f"{', '.join(elsewhere)} (see run.py {elsewhere[0]} --help)")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command = command
    return args


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """``--config`` (or ``base``) with every flag of the command and ``--set`` applied."""
    cfg = load(args.config) if base is None else base
    flags = [f for group in _flags_of(args.command).values() for f in group]
    # values, then --data-path, then switches, then --set: a later one wins (--bf16 over
    # --precision, --mock-data over --data-path)
    assignments = [f"{f.key}={value}" for f in flags if f.key and (value := getattr(args, f.dest)) is not None]
    if getattr(args, "data_path", None):
        assignments.append(f"data.source={' '.join(args.data_path)}")
    assignments += [f.switch for f in flags if f.switch and getattr(args, f.dest)]
    return override(cfg, assignments + args.overrides)


def flag(args: argparse.Namespace, name: str) -> str | None:
    """The value given for a config-key flag (None when not given or not the command's)."""
    return getattr(args, f"flag:{name}", None)

