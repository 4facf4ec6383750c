"""From ``parallel.*`` config values to a Strategy and a plan (no process group needed)."""

from __future__ import annotations

from fxmega.config import ParallelConfig, RunConfig
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models.family import ModelFamily
from fxmega.optim.optimizer import optimizer_for, state_bytes
from fxmega.sharding.mesh import MeshSpec
from fxmega.sharding.pipeline import PipelineLayout, make_pipeline
from fxmega.sharding.plan import ADAMW_STATE_BYTES, ShardingPlan, make_plan
from fxmega.sharding.rules import Strategy, preset


def strategy_from(p: ParallelConfig) -> Strategy:
    if isinstance(p.rules, dict):
        base = Strategy(dict(p.rules), 0, "custom")
    elif isinstance(p.rules, str):
        base = preset(p.rules)
    else:
        raise ConfigError(f"parallel.rules must be a preset name or a dict, got {type(p.rules).__name__}")
    rules = dict(base.rules)
    if p.sequence_parallel:
        rules["seq"] = "tp"
    zero = base.zero if p.zero < 0 else p.zero
    name = base.name + (f" + zero {zero}" if p.zero >= 0 and p.zero != base.zero else "")
    if p.distributed_optimizer:
        name += ", distributed optimizer"
    return Strategy(rules, zero, name, p.distributed_optimizer)


def plan_from(specs: tree.Tree, p: ParallelConfig, model: ModelFamily | None = None,
              opt_state_bytes: int = ADAMW_STATE_BYTES) -> ShardingPlan:
    """The plan for ``p``; ``model`` (the family) is needed when the mesh has pp;
    ``opt_state_bytes``: the optimizer's state per parameter element (``optim.optimizer.state_bytes``)."""
    mesh = MeshSpec.parse(p.mesh)
    pipeline, groups = None, ((), ())
    if mesh.size("pp") > 1:
        if model is None:
            raise ConfigError("a mesh with pp needs the model module to cut stages")
        pipeline = pipeline_from(specs, mesh.size("pp"), p, model)
        groups = (model.EMBED_PARAMS, model.head_groups(specs))
    return make_plan(specs, mesh, strategy_from(p), pipeline, groups, opt_state_bytes)


def run_plan(cfg: RunConfig, model: ModelFamily) -> ShardingPlan:
    """The plan of a run: ``model``'s parameters on ``cfg.parallel``, with the bytes of the
    optimizer ``cfg.optim`` names (an unknown one is refused here, before any rank starts)."""
    return plan_from(model.param_specs(cfg.model), cfg.parallel, model, state_bytes(optimizer_for(cfg.optim)))


def pipeline_from(specs: tree.Tree, pp: int, p: ParallelConfig, model: ModelFamily) -> PipelineLayout:
    """Stages for ``pp`` ranks, costed in blocks: a block by its parameter count, the head by
    its own parameters (the vocabulary projection, tied or not), the embedding lookup as 0."""
    block = sum(s.numel for s in tree.leaves(specs["blocks"][0]))
    head = sum(s.numel for path, s in tree.items({k: specs[k] for k in model.head_groups(specs)})
               if "vocab" in s.axes or path.split(".")[0] not in model.EMBED_PARAMS)
    return make_pipeline(len(specs["blocks"]), pp, p.virtual_stages, p.pipeline_schedule, p.pipeline_layout,
                         0.0, head / block)
