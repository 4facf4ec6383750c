"""Every check a run makes before anything is built, in one place.

``preflight`` is what the launching process runs before it starts any rank (and what a
rank runs again before it builds its ``Parallel``): the config's own fields, the mesh
against the model (divisibility, stage counts, the family's refusals: ``checked_plan``),
the batch arithmetic on the plan's data size, and the compute options this model, mesh and
device cannot honour (``check_compute``). A combination that cannot work is refused with
one ``ConfigError`` naming the value and the fix; nothing falls back silently.
"""

from __future__ import annotations

import dataclasses

import torch

from fxmega.config import RunConfig
from fxmega.core.errors import ConfigError
from fxmega.core.log import get_logger
from fxmega.models import family_name
from fxmega.models.family import ModelFamily
from fxmega.models.weight_uses import fp8_matmul_count
from fxmega.ops import fp8, kernels
from fxmega.ops.objectives import Objective
from fxmega.optim.optimizer import optimizer_for
from fxmega.parallel.distributed import checked_plan
from fxmega.sharding.mesh import MeshSpec
from fxmega.sharding.plan import ShardingPlan
from fxmega.storage import checkpoint, checkpoint_files

log = get_logger(__name__)


def preflight(cfg: RunConfig, model: ModelFamily, device: torch.device) -> ShardingPlan | None:
    """Every check of ``cfg`` on its mesh (``parallel.mesh``) with ``model`` on ``device``;
    returns the plan (None for a one-device run). Needs no process group."""
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    plan = checked_plan(cfg, mesh, model) if mesh.world_size > 1 else None
    check_run(cfg, plan, device, model)
    return plan


def check_run(cfg: RunConfig, plan: ShardingPlan | None, device: torch.device, model: ModelFamily) -> RunConfig:
    """The config's fields with the batch arithmetic on ``plan``'s data size, then the compute
    options (``check_compute``); returns ``cfg``."""
    cfg.validate(1 if plan is None else plan.mesh.data_size)
    check_optimizer(cfg)  # an optimizer it does not know is refused here
    check_compute(cfg, plan, device, model)
    return cfg


def check_optimizer(cfg: RunConfig) -> None:
    """The optimizer ``optim.optimizer`` names exists. One that updates whole matrices (Muon)
    runs on every layout: tp, ZeRO and fsdp slices are gathered per matrix
    (``fxmega.parallel.matrix_pieces``), and the distributed optimizer gives each matrix to
    one owner rank (``fxmega.parallel.flat_optimizer``)."""
    optimizer_for(cfg.optim)


def check_compute(cfg: RunConfig, plan: ShardingPlan | None, device: torch.device, model: ModelFamily) -> None:
    """Refuse, before anything is built, the ``compute`` options (and ``data.pack``) this model
    and mesh cannot honour (no silent fallback)."""
    c, t = cfg.compute, cfg.train
    kernels.check_available(c.kernels, device)
    if c.fp8 != "off":
        if plan is not None:
            fp8.check_mesh(c.fp8, plan.mesh)
        fp8.recipe_for(c.fp8, device)  # torchao is installed
        fp8.check_applies(c.fp8, fp8_matmul_count(cfg.model, plan.tp_shapes() if plan is not None else None, model),
                          cfg.model.d_model)
    if c.fp8_gather:
        fp8.check_gather(c.fp8)
        if plan is None or not plan.gathers_params:
            raise ConfigError("compute.fp8_gather=true carries ZeRO-3 / fsdp's parameter all-gathers in fp8; this run "
                              "gathers no parameters: add --rules zero3 (or an fsdp axis to --mesh), or drop "
                              "--fp8-gather")
    if t.cuda_graphs:
        if device.type != "cuda":
            raise ConfigError(f"train.cuda_graphs=true replays the step's GPU kernels from a captured CUDA graph; this "
                              f"run is on {device.type}: set train.cuda_graphs=false")
        if not (t.compile and t.compile_backend == "inductor"):
            raise ConfigError("train.cuda_graphs=true captures inductor's compiled step: set train.compile=true and "
                              "train.compile_backend=inductor, or train.cuda_graphs=false")
        if plan is not None:
            raise ConfigError(f"train.cuda_graphs=true is measured on one device only; this run is on a mesh of "
                              f"{plan.mesh.world_size} ranks (collectives inside captured graphs are not "
                              f"tested here): set train.cuda_graphs=false")
    if cfg.parallel.async_tp:
        if device.type != "cuda":
            raise ConfigError(f"parallel.async_tp=true runs torch's micro-pipelined tensor parallelism, which "
                              f"exchanges the chunks through CUDA symmetric memory; this run is on {device.type}: "
                              f"set parallel.async_tp=false")
        if plan is None or plan.tp < 2:
            tp = 1 if plan is None else plan.tp
            raise ConfigError(f"parallel.async_tp=true overlaps tensor parallelism's collectives; this mesh has "
                              f"tp={tp}: give the mesh a tp axis (e.g. --mesh dp=1,tp=2) or set "
                              f"parallel.async_tp=false")
    if cfg.parallel.overlap_param_gather:
        zero = 0 if plan is None else plan.zero
        if zero not in (1, 2):
            raise ConfigError(f"parallel.overlap_param_gather=true defers ZeRO-1/2's all-gather of the updated "
                              f"shards; this run has ZeRO-{zero}" + (" on one device" if plan is None else "")
                              + ": set parallel.zero=1 (or 2) on a mesh with a data axis, or "
                                "parallel.overlap_param_gather=false")
        if plan.pipeline is not None:
            raise ConfigError("parallel.overlap_param_gather=true is not supported with pipeline parallelism yet "
                              "(the stages' forwards run in torch's schedule, outside the step's graph): set "
                              "parallel.overlap_param_gather=false")
    if cfg.data.pack and not model.CONTEXT_PARALLEL:
        raise ConfigError(f"data.pack=true restarts the positions in every packed conversation; the "
                          f"{family_name(cfg.model)} model does not take a position per token (GPT, Llama and "
                          f"Mixtral do): set data.pack=false")
    if c.loss_chunk and not model.can_chunk_loss:
        raise ConfigError(f"compute.loss_chunk={c.loss_chunk}: the {family_name(cfg.model)} head is not a final norm "
                          f"and one output projection (final_hidden, output_weight), which the chunked loss "
                          f"needs: set compute.loss_chunk=0")
    extra_head_groups = model.head_groups(model.param_specs(cfg.model))[len(model.HEAD_PARAMS):] if c.loss_chunk else ()
    if extra_head_groups:
        raise ConfigError(f"compute.loss_chunk={c.loss_chunk}: the {family_name(cfg.model)} head also runs "
                          f"{', '.join(extra_head_groups)} "
                          f"(multi-token prediction), which the chunked loss, a final norm and one projection, "
                          f"leaves out: set compute.loss_chunk=0, or model.mtp_depth=0")
    if not c.loss_chunk or plan is None:
        return
    if plan.tp > 1:
        raise ConfigError(f"compute.loss_chunk={c.loss_chunk} works on an unsplit vocabulary; with "
                          f"tp={plan.tp} "
                          f"the logits are already split over the vocabulary (vocab-parallel cross-entropy): set "
                          f"compute.loss_chunk=0")
    if plan.pipeline is not None:
        raise ConfigError("compute.loss_chunk is not supported with pipeline parallelism yet (the last stage "
                          "computes the loss from whole logits): set compute.loss_chunk=0")


def check_reference(cfg: RunConfig, plan: ShardingPlan | None, objective: Objective, reference: str | None) -> None:
    """Refuse a frozen reference model (``training.reference``) where it cannot work: an
    objective that reads one without it, one given to an objective that does not read it
    (memory for nothing), and the paths that do not compute its outputs yet."""
    if objective.reads_reference and reference is None:
        raise ConfigError(f"the {objective.name} objective reads a reference model's outputs: give the run a "
                          f"checkpoint of it (Run(..., reference=CKPT))")
    if reference is None:
        return
    if not objective.reads_reference:
        raise ConfigError(f"a reference model ({reference}) was given, but the {objective.name} objective does not "
                          f"read one: it would only take memory; drop it or use an objective that reads it")
    if cfg.compute.loss_chunk:
        raise ConfigError(f"compute.loss_chunk={cfg.compute.loss_chunk} computes the cross-entropy a chunk at a time "
                          f"without whole outputs, which the {objective.name} objective compares with the reference "
                          f"model's: set compute.loss_chunk=0")
    if plan is not None and plan.pipeline is not None:
        raise ConfigError(f"a reference model is not supported with pipeline parallelism yet (its forward would need "
                          f"its own pass through the stages' schedule): run {objective.name} on a mesh without pp")


def saved_optimizer(path: str) -> str | None:
    """The optimizer a checkpoint's run trained with (its meta records the config), or None
    where ``path`` holds no checkpoint yet or one that keeps only parameters."""
    found = checkpoint.resolve(path)
    if found is None:
        return None
    meta = checkpoint_files.read_meta(found)
    if meta.get("params_only"):
        return None
    return meta.get("config", {}).get("optim", {}).get("optimizer")


def resume_optimizer(cfg: RunConfig, asked: bool) -> RunConfig:
    """``cfg`` resuming ``train.load_dir`` with the optimizer its checkpoint trained with:
    that optimizer's state (Muon's momentum, AdamW's two moments) only continues itself. Not
    ``asked`` for one (no --optimizer, no optim.optimizer=): the saved one, said. Asked for
    another: refused, naming both, unless ``train.finetune`` loads the parameters only."""
    t = cfg.train
    saved = saved_optimizer(t.load_dir) if t.load_dir and not t.finetune else None
    if saved is None or saved == cfg.optim.optimizer:
        return cfg
    if asked:
        raise ConfigError(f"--load {t.load_dir} was trained with {saved}; this run asks for {cfg.optim.optimizer}, and "
                          f"{saved}'s optimizer state cannot continue as {cfg.optim.optimizer}'s: resume with "
                          f"--optimizer {saved} (or leave --optimizer out), or add --finetune to load the parameters "
                          f"only and start {cfg.optim.optimizer} fresh")
    log.info(f"resuming with {saved}, the optimizer {t.load_dir} was trained with (the config says "
             f"{cfg.optim.optimizer}; --optimizer {cfg.optim.optimizer} --finetune would start it fresh)")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer=saved))

