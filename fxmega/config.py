"""Run configuration: frozen dataclasses, Python config files, command-line overrides and
validation.

A config file is a Python file that sets ``config = RunConfig(...)``; users copy one from
``configs/`` and edit it. ``--set train.lr=3e-4`` overrides any field by its dotted path.
Every rejected value raises ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import runpy
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxmega.core.compute import ComputeConfig
from fxmega.core.errors import ConfigError
from fxmega.data.gpt_dataset import parse_split
from fxmega.models import family_name, model_for, registry
from fxmega.models.family import ModelConfig
from fxmega.ops import fp8
from fxmega.sharding.pipeline import SCHEDULES as PIPELINE_SCHEDULES

CP_ATTENTION = ("allgather", "ring", "a2a")  # parallel.cp_attention

# torch.compile backends a run may use: inductor generates fused kernels; aot_eager traces
# the same forward+backward graph (collectives included) and runs it op by op, which
# compiles in seconds instead of a minute on a CPU (debugging, and the tests that check
# graphs rather than kernels)
COMPILE_BACKENDS = ("inductor", "aot_eager")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "selective", "full")
KERNELS = ("reference", "triton")

SCHEDULES = ("constant", "linear", "cosine", "wsd", "inverse-sqrt")
WSD_DECAY_STYLES = ("linear", "cosine", "1-sqrt")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # optimizer steps (Megatron: --train-iters)
    micro_batch_size: int = 8  # sequences per forward/backward on one data-parallel rank
    global_batch_size: int = 8  # sequences per optimizer step, all ranks and microbatches
    seq_len: int = 256  # tokens per sequence (Megatron: --seq-length)
    seed: int = 1234
    compile: bool = True  # one torch.compile'd step; False runs the same step eagerly
    compile_backend: str = "inductor"  # inductor (fused kernels) | aot_eager (same graphs, no codegen: debugging)
    cuda_graphs: bool = False  # replay the compiled step as CUDA graphs (inductor's cudagraph trees); one CUDA device
    device: str = "auto"  # auto (cuda if present, else cpu) | cpu | cuda
    eval_interval: int = 200  # steps between validation passes; 0 evaluates only at the end
    eval_iters: int = 20  # validation batches per pass
    log_interval: int = 10
    log_jsonl: str = ""  # one JSON object per step, when set
    tensorboard_dir: str = ""  # TensorBoard event files, when set and tensorboard is installed
    wandb_project: str = ""  # log to Weights & Biases (offline unless WANDB_MODE says otherwise)
    mlflow_uri: str = ""  # log to MLflow at this tracking URI (an http server, sqlite:///..., file:...)
    mlflow_experiment: str = ""  # default: the run's name
    tracking_dir: str = "runs/tracking"  # where offline trackers keep their files
    save_dir: str = ""  # checkpoints (Megatron: --save); empty: do not save
    save_interval: int = 0  # steps between checkpoints; 0 saves at the end only
    load_dir: str = ""  # resume from the latest checkpoint here, or this step directory (Megatron: --load)
    finetune: bool = False  # --load only the parameters; optimizer and step start fresh (Megatron: --finetune)
    keep_last: int = 0  # keep only the newest K checkpoints; 0 keeps all
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms; on CUDA also cuBLAS)
    nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop (with diagnostics) | skip (drop the update, go on)
    diagnostics_dir: str = "runs/diagnostics"  # where a stop writes what went wrong
    spike_z: float = 6.0  # warn when a loss is this many std above the last 50 steps' mean; 0: off
    async_save: bool = False  # write checkpoints in a background thread while training continues
    prefetch: int = 2  # global batches the loop builds ahead in a background thread; 0 builds each when due
    sample_tokens: int = 0  # tokens to generate after training
    sample_prompt: str = "\n"
    peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0 looks it up or measures it
    dump_kernels: str = ""  # write each compiled graph's FX graph, generated code and kernel index here


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # fxmega.optim's registry: adamw | muon
    lr: float = 6e-4
    min_lr: float = 0.0
    schedule: str = "cosine"  # constant | linear | cosine | wsd | inverse-sqrt
    warmup_steps: int = 0
    decay_steps: int = 0  # steps of decay after warmup; 0 means until train.steps
    wsd_decay_steps: int = 0  # length of WSD's final decay; 0 means 20% of train.steps
    wsd_decay_style: str = "1-sqrt"  # linear | cosine | 1-sqrt
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global gradient norm; 0 disables clipping
    decay_embeddings: bool = False  # weight-decay the embedding tables too
    # Muon (optimizer=muon: the hidden matrices; AdamW above for the rest, at the same lr)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations


@dataclass(frozen=True)
class DataConfig:
    # shakespeare | mock | a UTF-8 text file | an indexed-dataset prefix (PREFIX.bin/.idx) |
    # a blend of prefixes "0.7 A 0.3 B" (Megatron: --data-path)
    source: str = "shakespeare"
    data_dir: str = "data"  # where fetched corpora and vocabulary files are cached
    tokenizer: str = "byte"  # byte | gpt2 | gpt2-bpe:V,M | tiktoken:[NAME=]F | hf:F | sentencepiece:F
    valid_fraction: float = 0.05  # text sources: tail of the corpus held out for validation
    split: str = "949,50,1"  # indexed sources: train,valid,test weights over documents (Megatron: --split)
    cache_dir: str = ""  # sample-index cache; empty: DATA_DIR/index-cache (Megatron: --data-cache-path)
    # pretrain: the objective's own data from the source (next tokens, masked tokens, spans);
    # seq2seq: source -> target pairs (a .jsonl of {src, tgt}, or SRC.txt,TGT.txt) for an encoder-decoder;
    # sft: conversations ({messages}, {prompt, response} or {src, tgt} lines), loss on the assistant's tokens
    task: str = "pretrain"
    valid_source: str = ""  # seq2seq/sft: the validation file; empty: data.valid_fraction of the source's, by hash
    # sft: several conversations per row, attention and positions inside each (NeMo's packed SFT)
    pack: bool = False


DATA_TASKS = ("pretrain", "seq2seq", "sft")


@dataclass(frozen=True)
class ParallelConfig:
    mesh: str = "1"  # "2x2" (sizes for dp, tp, pp in turn) or "dp=2,tp=2"
    rules: str | dict = "megatron"  # a preset name (fxmega.sharding.rules.PRESETS) or a rules dict
    zero: int = -1  # ZeRO stage 0-3 over dp; -1 takes the preset's
    sequence_parallel: bool = False  # split the residual stream along seq over tp
    bucket_size: int = 40_000_000  # elements per gradient-reduction bucket (Megatron: --ddp-bucket-size)
    timeout_s: int = 600  # collectives that wait longer fail instead of hanging
    # ZeRO-1/2 over flat per-bucket buffers, each data rank a contiguous slice of each (Megatron:
    # --use-distributed-optimizer): any data size shards any model; off: along each tensor's embed dim
    distributed_optimizer: bool = False
    # inductor reorders collectives to overlap compute: each one issued once its inputs exist, its
    # wait sunk to its first use (Megatron: --overlap-grad-reduce, --overlap-param-gather)
    overlap_comm: bool = False
    # ZeRO-1/2: the updated shards are all-gathered at the start of the next step, each bucket's
    # wait just before the first layer that reads it, instead of at the end of this one
    # (Megatron: --overlap-param-gather); parameters are made whole before anything else reads them
    overlap_param_gather: bool = False
    # tensor-parallel matmuls split into chunks so their sequence-parallel all-gathers and
    # reduce-scatters overlap the chunks' compute (torch's micro-pipelined TP on symmetric
    # memory; Megatron: --tp-comm-overlap); CUDA only
    async_tp: bool = False
    zero3_regather: bool = True  # ZeRO-3: re-gather parameters in the backward instead of keeping them
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zero-bubble
    virtual_stages: int = 1  # stages per pp rank (interleaved schedules; Megatron: virtual pipeline size)
    # stages like "Et*3|t*4|t*3L"; empty: balanced by cost (Megatron: --pipeline-model-parallel-layout)
    pipeline_layout: str = ""
    # how attention reaches keys on other cp ranks (Megatron: --cp-comm-type): allgather (each
    # rank gathers the keys and values) or a2a (Ulysses: all-to-all from sequence to head shards)
    cp_attention: str = "allgather"


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    name: str = "run"

    def validate(self, data_parallel_size: int | None = 1) -> RunConfig:
        """Every check; ``None`` skips the one that needs the mesh (batch divisibility), for
        checking a config before a plan is made from it."""
        _validate(self, data_parallel_size)
        return self

    def grad_accum_steps(self, data_parallel_size: int = 1) -> int:
        t = self.train
        return t.global_batch_size // (t.micro_batch_size * data_parallel_size)


def load(path: str | Path) -> RunConfig:
    """Run a config file and return its ``config``."""
    path = Path(path)
    if not path.is_file():
        hint = ", ".join(sorted(p.name for p in Path("configs").glob("*.py"))) if Path("configs").is_dir() else ""
        raise ConfigError(f"config file {str(path)!r} does not exist" + (f"; configs/ has: {hint}" if hint else ""))
    namespace = runpy.run_path(str(path))
    cfg = namespace.get("config")
    if not isinstance(cfg, RunConfig):
        raise ConfigError(
            f"{path} must set `config = RunConfig(...)` (from fxmega.config); found {type(cfg).__name__}"
        )
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain dict of the config (for logs and checkpoints), with the model family named."""
    out = dataclasses.asdict(cfg)
    out["model"]["family"] = family_name(cfg.model)
    return out


def from_dict(d: dict[str, Any], family: str | None = None, where: str = "the config") -> RunConfig:
    """The ``RunConfig`` that ``to_dict`` wrote (a checkpoint's ``config``): sections and
    fields it lacks take their defaults; ``family`` names the model's family when
    ``d["model"]`` does not. A field this version does not know is an error naming it."""
    model = dict(d.get("model") or {})
    name = model.pop("family", None) or family
    if name is None:
        raise ConfigError(f"{where} does not name its model family: give --config")
    fields: dict[str, Any] = {"model": _build(registry.get(name).Config, model, f"{where}: model")}
    for section in dataclasses.fields(RunConfig):
        if section.name != "model" and section.name in d:
            value = d[section.name]
            fields[section.name] = value if section.name == "name" else \
                _build(typing.get_type_hints(RunConfig)[section.name], value, f"{where}: {section.name}")
    return RunConfig(**fields)


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} is {type(values).__name__}, not an object of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where} has {', '.join(unknown)}, which {cls.__name__} does not know (written by another "
                          f"version of fxmega?): give --config")
    hints = typing.get_type_hints(cls)  # nested sections (a model's rope_scaling) are dicts in the file
    return cls(**{k: _build(hints[k], v, f"{where}.{k}") if dataclasses.is_dataclass(hints[k]) else v
                  for k, v in values.items()})


def override(cfg: RunConfig, assignments: list[str]) -> RunConfig:
    """Apply ``key.path=value`` assignments, parsing each value as its field's type."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise ConfigError(f"override {assignment!r} has no '=': write it as key.path=value, e.g. train.lr=3e-4")
        key = key.strip()
        known = _all_keys(cfg)
        if key not in known and not any(k.startswith(key + ".") for k in known):
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, known)}")
        cfg = _set(cfg, key.split("."), raw.strip(), key)
    return cfg


def _suggest(key: str, known: list[str]) -> str:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
    close += [k for k in known
              if k not in close and difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.7)]
    if close:
        return f"; did you mean {' or '.join(close[:3])}?"
    sections = sorted({k.split(".")[0] for k in known})
    return f"; keys live in the sections {', '.join(sections)} (see configs/ for examples)"


def _set(obj: Any, keys: list[str], raw: str, full_key: str) -> Any:
    current = getattr(obj, keys[0])
    if len(keys) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"config key {full_key!r}: {keys[0]!r} is a value, not a section")
        return dataclasses.replace(obj, **{keys[0]: _set(current, keys[1:], raw, full_key)})
    if dataclasses.is_dataclass(current):
        first = dataclasses.fields(current)[0].name
        raise ConfigError(f"config key {full_key!r} is a section: set one of its fields, e.g. {full_key}.{first}=...")
    kind = typing.get_type_hints(type(obj))[keys[0]]
    return dataclasses.replace(obj, **{keys[0]: parse_value(raw, kind, full_key)})


def parse_value(raw: str, kind: Any, key: str) -> Any:
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected true or false")
    if kind in (int, float):
        try:
            value = float(raw) if kind is float else int(raw)
        except ValueError:
            example = "3e-4" if kind is float else "8"
            what = "a number" if kind is float else "a whole number"
            raise ConfigError(f"{key}={raw!r}: expected {what}, e.g. {key}={example}") from None
        return value
    if kind is str or (isinstance(kind, types.UnionType) and str in typing.get_args(kind)):
        return raw
    raise ConfigError(f"{key} cannot be set from the command line (type {kind}); set it in the config file")


def _all_keys(obj: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _validate_compute(c: ComputeConfig) -> None:
    _require(c.precision in PRECISIONS, f"compute.precision={c.precision!r}: use one of {', '.join(PRECISIONS)}")
    _require(c.grad_reduce in ("fp32", "bf16"), f"compute.grad_reduce={c.grad_reduce!r}: use fp32 or bf16")
    _require(c.loss_scale >= 0, f"compute.loss_scale={c.loss_scale} must be zero (dynamic) or positive")
    _require(c.min_loss_scale > 0 and c.initial_loss_scale >= c.min_loss_scale,
             f"compute.initial_loss_scale={c.initial_loss_scale} must be at least compute.min_loss_scale="
             f"{c.min_loss_scale} > 0")
    _require(c.loss_scale_window > 0 and c.hysteresis > 0,
             f"compute.loss_scale_window={c.loss_scale_window} and compute.hysteresis={c.hysteresis} must be positive")
    _require(c.recompute in RECOMPUTE_MODES,
             f"compute.recompute={c.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    _require(c.recompute_layers >= 0, f"compute.recompute_layers={c.recompute_layers} must be zero (all) or positive")
    _require(c.kernels in KERNELS, f"compute.kernels={c.kernels!r}: use one of {', '.join(KERNELS)}")
    fp8.check_recipe(c.fp8)
    _require(c.loss_chunk >= 0, f"compute.loss_chunk={c.loss_chunk} must be zero (no chunks) or positive")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_inductor(t: TrainConfig, on: bool, setting: str, why: str) -> None:
    """A setting that only inductor's compiler carries out, refused elsewhere."""
    _require(not on or (t.compile and t.compile_backend == "inductor"),
             f"{setting}=true {why}; this run has train.compile={t.compile}, train.compile_backend="
             f"{t.compile_backend!r}: compile with inductor (train.compile=true, train.compile_backend=inductor) "
             f"or set {setting}=false")


def _validate(cfg: RunConfig, dp: int | None) -> None:
    model_for(cfg.model)  # the Config of a registered family, or a ConfigError naming those there are
    cfg.model.validate("model")
    t, o, d = cfg.train, cfg.optim, cfg.data
    for name in ("steps", "micro_batch_size", "global_batch_size", "seq_len", "eval_iters", "log_interval"):
        _require(getattr(t, name) > 0, f"train.{name}={getattr(t, name)} must be positive")
    for name in ("eval_interval", "save_interval", "sample_tokens", "keep_last", "prefetch"):
        _require(getattr(t, name) >= 0, f"train.{name}={getattr(t, name)} must be zero or positive")
    _require(t.seq_len <= cfg.model.max_seq_len,
             f"train.seq_len={t.seq_len} is longer than model.max_seq_len={cfg.model.max_seq_len}: "
             f"lower train.seq_len or raise model.max_seq_len")
    per_step = t.micro_batch_size * (dp or 1)
    _require(dp is None or t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
             f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}: the global batch is "
             f"micro batch x accumulation steps x data-parallel size; use e.g. "
             f"train.global_batch_size={per_step * max(1, round(t.global_batch_size / per_step))}")
    _require(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r}: use auto, cpu or cuda")
    _require(t.compile_backend in COMPILE_BACKENDS,
             f"train.compile_backend={t.compile_backend!r}: use one of {', '.join(COMPILE_BACKENDS)}")
    _require(t.nonfinite in ("stop", "skip"), f"train.nonfinite={t.nonfinite!r}: use stop or skip")
    _require(o.schedule in SCHEDULES, f"optim.schedule={o.schedule!r}: use one of {', '.join(SCHEDULES)}")
    _require(o.wsd_decay_style in WSD_DECAY_STYLES,
             f"optim.wsd_decay_style={o.wsd_decay_style!r}: use one of {', '.join(WSD_DECAY_STYLES)}")
    _require(o.lr >= 0 and o.min_lr >= 0, f"optim.lr={o.lr} and optim.min_lr={o.min_lr} must not be negative")
    _require(o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}")
    for name in ("warmup_steps", "decay_steps", "wsd_decay_steps"):
        _require(getattr(o, name) >= 0, f"optim.{name}={getattr(o, name)} must be zero or positive")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optim.beta1={o.beta1}, optim.beta2={o.beta2} must be in [0, 1)")
    _require(o.eps > 0, f"optim.eps={o.eps} must be positive")
    _require(0 <= o.muon_momentum < 1, f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
    _require(o.muon_ns_steps >= 1, f"optim.muon_ns_steps={o.muon_ns_steps} must be at least 1")
    _require(o.weight_decay >= 0 and o.clip_grad >= 0, "optim.weight_decay and optim.clip_grad must not be negative")
    _require(0 < d.valid_fraction < 1, f"data.valid_fraction={d.valid_fraction} must be between 0 and 1")
    _require(d.task in DATA_TASKS, f"data.task={d.task!r}: use one of {', '.join(DATA_TASKS)}")
    _require(not d.pack or d.task == "sft", f"data.pack=true packs conversations (data.task=sft); data.task={d.task!r}"
                                            f" batches are already full rows: set data.pack=false")

    parse_split(d.split)  # raises ConfigError naming the value
    _validate_compute(cfg.compute)
    p = cfg.parallel
    _require(p.zero in (-1, 0, 1, 2, 3), f"parallel.zero={p.zero}: use 0, 1, 2 or 3")
    _require(p.bucket_size >= 0, f"parallel.bucket_size={p.bucket_size} must be zero (one bucket) or positive")
    _require(p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be positive")
    _require_inductor(t, p.overlap_comm, "parallel.overlap_comm",
                      "needs inductor's scheduler (elsewhere the ops run in traced order)")
    _require(not p.overlap_param_gather or p.overlap_comm,
             "parallel.overlap_param_gather=true moves the parameter all-gather to the start of the next step so "
             "that inductor's overlap passes can hide it behind the forward; without parallel.overlap_comm=true "
             "nothing moves its waits: set parallel.overlap_comm=true (--overlap-comm) as well")
    _require_inductor(t, p.async_tp, "parallel.async_tp",
                      "is an inductor pass (it rewrites all-gather + matmul and matmul + reduce-scatter)")
    _require(not p.async_tp or p.sequence_parallel,
             "parallel.async_tp=true overlaps sequence parallelism's all-gathers and reduce-scatters with the "
             "matmuls they feed; without parallel.sequence_parallel=true tp reduces by all-reduce, which it does "
             "not split: set parallel.sequence_parallel=true or parallel.async_tp=false")

    _require(p.pipeline_schedule in PIPELINE_SCHEDULES,
             f"parallel.pipeline_schedule={p.pipeline_schedule!r}: use one of {', '.join(PIPELINE_SCHEDULES)}")
    _require(p.virtual_stages >= 1, f"parallel.virtual_stages={p.virtual_stages} must be at least 1")
    _require(p.cp_attention in CP_ATTENTION, f"parallel.cp_attention={p.cp_attention!r}: use one of "
             f"{', '.join(CP_ATTENTION)}")
