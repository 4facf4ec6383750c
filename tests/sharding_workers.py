"""Code that runs inside the ranks of the sharding tests (see multirank.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch._dynamo.utils import counters

from fxmega.compiler.inspect import record_collectives
from fxmega.config import ParallelConfig, load, override
from fxmega.core import tree
from fxmega.core.memory import current_bytes, peak_bytes, reset_peak
from fxmega.parallel import distributed
from fxmega.parallel.runtime import Parallel
from fxmega.sharding.mesh import MeshSpec
from fxmega.training.run import Run
from tests.multirank import ROOT
from tests.parity import record
from tests.tiers import AOT_EAGER, E2E

# name -> parallel config; every one runs on 2 ranks
STRATEGIES = {
    "dp2": dict(mesh="dp=2"),
    "zero1": dict(mesh="dp=2", rules="zero1"),
    "zero2": dict(mesh="dp=2", rules="zero2"),
    "zero3": dict(mesh="dp=2", rules="zero3"),
    "fsdp2": dict(mesh="fsdp=2", rules="fsdp"),
    "tp2": dict(mesh="tp=2"),
    "tp2_sp": dict(mesh="tp=2", sequence_parallel=True),
}
BUCKET = 20_000  # elements: the tiny GPT's 120k parameters make several buckets
# Compiled with inductor (fused C++ kernels); the other strategies with aot_eager: the same
# AOTAutograd graph with the same collectives, run op by op, which compiles in seconds
# rather than a minute per rank on 2 CPU cores. Data parallelism's inductor builds are
# tests/test_overlap.py's (DP and ZeRO-3 read in the generated code, ZeRO-1 with the
# parameter gather equal to one device).
# Under make test, tp2_sp traces with aot_eager too (tests/tiers.py): the user-path matrix's tp_sp
# case builds inductor's kernels for tp+sp through run.py.
INDUCTOR_STRATEGIES = ("tp2_sp",) if E2E else ()


def tiny_config(parallel: dict | None = None, compile: bool = True, model: str = "tiny_gpt", extra: tuple = ()):
    """The tiny GPT with a vocabulary tp=2 does not divide (255, padded to 256 under tp)."""
    cfg = override(load(ROOT / "configs" / f"{model}.py"),
                   [f"train.compile={compile}", "train.global_batch_size=8", "train.micro_batch_size=4",
                    "train.device=cpu", "model.vocab_size=255", *extra])
    if parallel is not None:
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(bucket_size=BUCKET, **parallel))
    return cfg


def train(cfg, steps: int, collectives: bool) -> tuple[Parallel, dict, list]:
    """``steps`` steps of ``cfg`` on this rank: the plan, the run's record (tests.parity)
    and, with ``collectives``, the collectives of each compiled graph."""
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    if collectives:
        with record_collectives() as graphs:
            result = record(run, steps)
    else:
        result = record(run, steps)
    labels = par.groups.labels()
    return par, result, [[(c.op, labels.get(c.group, c.group), c.shape, c.bytes_sent_per_rank) for c in g]
                         for g in graphs]


def strategies(names: list[str], steps: int) -> dict | None:
    """Train each strategy for ``steps`` compiled steps; rank 0 returns losses, the full
    parameters, the number of compiled graphs, the recorded collectives and bucket facts."""
    out = {}
    for name in names:
        extra = () if name in INDUCTOR_STRATEGIES else AOT_EAGER
        par, result, collectives = train(tiny_config(STRATEGIES[name], extra=extra), steps, collectives=True)
        out[name] = {**result, "graphs": counters["stats"]["unique_graphs"],
                     "collectives": collectives, "n_params": len(par.shards.layouts),
                     "local_numels": [lay.local_numel("grad") for lay in par.shards.layouts],
                     "zero_dims": [lay.zero_dim for lay in par.shards.layouts]}
    return out if torch.distributed.get_rank() == 0 else None


def four_ranks(steps: int) -> dict | None:
    """dp2 x tp2 with sequence parallelism and ZeRO-1, on the tiny Llama (GQA, RoPE)."""
    cfg = tiny_config(dict(mesh="dp=2,tp=2", rules="zero1", sequence_parallel=True), model="tiny_llama",
                      extra=AOT_EAGER)
    _, result, collectives = train(cfg, steps, collectives=True)
    result |= {"graphs": counters["stats"]["unique_graphs"], "collectives": collectives}
    return result if torch.distributed.get_rank() == 0 else None


def sharded_init() -> list:
    """Each rank's local shards, with its coordinates, for tp=2 and for zero3 on dp=2."""
    out = []
    for parallel in (dict(mesh="tp=2"), dict(mesh="dp=2", rules="zero3")):
        cfg = tiny_config(parallel, compile=False)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        params = par.shards.init_params(cfg.train.seed, device)
        layouts = {lay.path: (lay.tp_dim, lay.zero_dim, lay.data_axes["param"]) for lay in par.shards.layouts}
        full = par.shards.full_tensors(tree.leaves(params))
        out.append({"coords": par.groups.coords, "local": {p: t.detach().clone() for p, t in tree.items(params)},
                    "layouts": layouts, "roundtrip": {p: t.clone() for p, t in zip(tree.paths(params), full)}})
    return out


def vocab_parallel_cross_entropy(vocab: int) -> dict:
    """Cross-entropy of logits split over tp (vocab padded to a multiple of 2): the loss and
    this rank's slice of d(loss)/d(logits)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fxmega.models import gpt
    from fxmega.ops import layers
    from fxmega.parallel.runtime import Parallel
    from fxmega.sharding import layout
    from fxmega.sharding.plan import make_plan
    from fxmega.sharding.rules import preset

    torch.manual_seed(0)
    padded = vocab + vocab % 2
    logits = torch.randn(3, 5, padded, dtype=torch.float64).float()
    targets = torch.randint(0, vocab, (3, 5))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    specs = gpt.param_specs(gpt.Config(vocab_size=vocab, max_seq_len=8, d_model=8, n_layers=1, n_heads=2))
    par = Parallel(make_plan(specs, MeshSpec.of(tp=2), preset("megatron")), mesh, torch.distributed.get_rank(), specs)
    rank = torch.distributed.get_rank()
    local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
    dt = DTensor.from_local(local, mesh, [Shard(2)], run_check=False)
    tgt = DTensor.from_local(targets, mesh, [torch.distributed.tensor.Replicate()], run_check=False)
    with layout.activate(par.activations):
        loss = layers.cross_entropy_sum(dt, tgt, vocab_size=vocab)
    loss = loss.full_tensor()
    loss.backward()
    return {"logits": logits, "targets": targets, "loss": loss.detach(), "grad": local.grad, "rank": rank}


def peak_memory(zero: int, regather: bool = True, d_model: int = 768, n_layers: int = 4, steps: int = 3,
                backend: str = "inductor") -> dict | None:
    """Memory of a compiled step (after warm-up) for a GPT whose parameters dominate memory,
    under ZeRO-``zero`` on dp=2: the state every rank keeps between steps (parameters and
    optimizer moments; exact, from the tensors) and what the step adds on top at its peak
    (measured: resident-set high-water mark minus resident set before the step). One
    variant per process: freed memory kept by the allocator would hide the next one's."""
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=16",
                    f"model.d_model={d_model}", "model.n_heads=8", f"model.n_layers={n_layers}",
                    "model.max_seq_len=16", f"train.compile_backend={backend}"])
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(mesh="dp=2", zero=zero, zero3_regather=regather))
    par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
    run = Run(cfg, par, device)
    for _ in range(steps - 1):
        run.do_step()
    reset_peak(device)
    before = current_bytes(device)
    run.do_step()
    step = peak_bytes(device) - before
    state = tree.leaves(run.params) + run.opt_state["exp_avg"] + run.opt_state["exp_avg_sq"]
    out = {"state": sum(t.numel() * t.element_size() for t in state), "step": step,
           "params": sum(t.numel() * t.element_size() for t in tree.leaves(run.params))}
    return out if torch.distributed.get_rank() == 0 else None


# glibc returns freed blocks above 64 KiB to the system at once, so RSS follows live tensors
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def resume(root: str, steps: int, parallel: dict | None = None, extra: tuple = ()) -> dict | None:
    """Train 2*steps straight, and steps + save + a fresh Run that resumes + steps, eagerly,
    with ZeRO-1 on dp=2 (sharded optimizer state in the checkpoint) unless told otherwise."""
    cfg = tiny_config(parallel or dict(mesh="dp=2", rules="zero1"), compile=False, extra=extra)
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    par, device = distributed.setup(cfg, mesh)
    straight = Run(cfg, par, device)
    expected = [straight.do_step()["loss"] for _ in range(2 * steps)]
    first = Run(cfg, par, device)
    got = [first.do_step()["loss"] for _ in range(steps)]
    first.save(root)
    second = Run(cfg, par, device)
    assert second.resume(root) and second.step == steps
    got += [second.do_step()["loss"] for _ in range(steps)]
    same = all(torch.equal(a, b) for a, b in zip(tree.leaves(second.params), tree.leaves(straight.params)))
    same = torch.tensor(float(same))
    torch.distributed.all_reduce(same, torch.distributed.ReduceOp.MIN)  # every rank's shards (pp: its stages)
    return {"expected": expected, "got": got, "params_equal": bool(same)} if torch.distributed.get_rank() == 0 \
        else None


def precision_variants(steps: int) -> dict | None:
    """bf16 on dp=2, eagerly: fp32 gradient reductions, bf16 ones, ZeRO-3, and the
    distributed optimizer's flat buckets reduce-scattered in bf16."""
    out = {}
    for name, parallel, extra in (("dp2", dict(mesh="dp=2"), ()),
                                  ("dp2_bf16_reduce", dict(mesh="dp=2"), ("compute.grad_reduce=bf16",)),
                                  ("zero3", dict(mesh="dp=2", rules="zero3"), ()),
                                  ("distopt_bf16_reduce", dict(mesh="dp=2", zero=1, distributed_optimizer=True),
                                   ("compute.grad_reduce=bf16",))):
        cfg = tiny_config(parallel, compile=False, extra=("model.vocab_size=256", "compute.precision=bf16", *extra))
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        out[name] = [run.do_step()["loss"] for _ in range(steps)]
    return out if torch.distributed.get_rank() == 0 else None


# The tiny BERT with four blocks (interleaved pipelines need a stage per virtual rank) and
# micro batches of 2: four per step on one data rank, two on each of two.
BERT_EXTRA = ("train.compile=false", "train.device=cpu", "model.n_layers=4", "train.micro_batch_size=2")


def bert_config(parallel: dict | None = None):
    cfg = override(load(ROOT / "configs" / "tiny_bert.py"), list(BERT_EXTRA))
    return cfg if parallel is None else dataclasses.replace(cfg, parallel=ParallelConfig(bucket_size=BUCKET,
                                                                                         **parallel))


def bert_mlm(runs: dict[str, dict], steps: int) -> dict | None:
    """Masked-LM steps of the tiny BERT on each mesh of ``runs`` (name -> parallel config),
    eagerly, in one process group: per run its record (tests.parity) and validation loss."""
    out = {}
    for name, parallel in runs.items():
        cfg = bert_config(parallel)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        out[name] = record(run, steps)
        out[name]["valid"] = run.evaluate()  # every rank takes part
    return out if torch.distributed.get_rank() == 0 else None


# The tiny T5 with micro batches of 2: four per step on one data rank, two on each of two.
T5_EXTRA = ("train.compile=false", "train.device=cpu", "train.micro_batch_size=2")


def t5_config(parallel: dict | None = None, extra: tuple = ()):
    cfg = override(load(ROOT / "configs" / "tiny_t5.py"), [*T5_EXTRA, *extra])
    return cfg if parallel is None else dataclasses.replace(cfg, parallel=ParallelConfig(bucket_size=BUCKET,
                                                                                         **parallel))


def t5_span_corruption(runs: dict[str, tuple[dict, tuple]], steps: int) -> dict | None:
    """Span-corruption steps of the tiny T5 on each mesh of ``runs`` (name -> (parallel
    config, config overrides)), in one process group: per run its record (tests.parity)."""
    out = {}
    for name, (parallel, extra) in runs.items():
        cfg = t5_config(parallel, extra)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        out[name] = record(Run(cfg, par, device), steps)
    return out if torch.distributed.get_rank() == 0 else None
