"""From ``parallel.*`` config values to a Strategy and a plan (no process group needed)."""

from __future__ import annotations

from fxmega import tree
from fxmega.config import ParallelConfig
from fxmega.errors import ConfigError
from fxmega.sharding.mesh import MeshSpec
from fxmega.sharding.plan import ShardingPlan, make_plan
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
    return Strategy(rules, zero, name)


def plan_from(specs: tree.Tree, p: ParallelConfig) -> ShardingPlan:
    return make_plan(specs, MeshSpec.parse(p.mesh), strategy_from(p))
