"""``run.py plan --mesh auto --devices N --memory-per-device 80GB``: search the parallel layouts.

Every candidate is a full fxmega run setting — mesh ``dp x tp x pp x cp`` (a mixture of
experts also ``ep``, folded over the data ranks), ZeRO stage, recompute mode, pipeline
schedule, cp attention (sequence parallelism is on whenever tp > 1: it only saves memory).
Expert parallelism is searched over the divisors of dp that divide the experts. Context
parallelism is searched for models that take it, with cp chunks of at least
``MIN_CP_CHUNK`` tokens (shorter ones leave a GPU's attention kernels idle), both
all-gather and ring attention: the ring holds less, the all-gather sends less.
Each goes through the same planner and checks a real run goes through (``plan_from``,
``validate``, the schedule's micro-batch rules), so a candidate that does not divide is
rejected with the planner's own message. The survivors are priced by
``fxmega.planning.estimate`` and ``fxmega.planning.traffic``: memory per rank against the
budget, and step time

    compute  = model FLOPs per rank x (4/3 with full recompute) / (peak x efficiency)
    tp       = tp bytes / bandwidth of the tp group (NVLink inside a node, else the network)
    cp       = cp bytes (attention's exchanges, the gradients' sum) / bandwidth of the cp
               group, not hidden (nothing orders attention's exchanges behind compute yet)
    ep       = ep bytes (the experts' all-to-alls) / bandwidth of the ep group, not hidden
               (each exchange feeds the experts' compute right after it)
    data     = gradient/parameter traffic / its bandwidth; with --overlap-comm (set on every
               candidate when the run compiles with inductor) hidden behind the backward
               (behind the whole step for ZeRO-3's gathers) as far as it fits; without it
               exposed in full, as the traced order waits for each collective where it is
               issued (``plan --rank R`` replays one rank's traced graphs both ways at the
               profile's rates: ``fxmega.planning.exposure``)
    pipeline = bubble (pp - 1) / (virtual x micro batches) of compute + tp, plus the sends
    step     = (compute + tp + cp + ep) x (1 + bubble) + exposed data + pipeline sends

and ranked by step time. The estimate prices what fxmega's runtime does (no communication
overlap inside tp, bucketed data-parallel reductions, the data axes' collectives reordered by
inductor when --overlap-comm is on); it is a planning model, not a simulator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fxmega.config import RunConfig, override
from fxmega.core.errors import ConfigError
from fxmega.models import model_for
from fxmega.parallel.context import check_context_parallel
from fxmega.parallel.strategy import run_plan
from fxmega.planning.devices import DeviceProfile
from fxmega.planning.report import estimate_plan, text_table
from fxmega.sharding.pipeline import check_microbatches
from fxmega.training.metrics import model_flops_per_token

SCHEDULE_CHOICES = (("1f1b", 1), ("interleaved-1f1b", 2))
RECOMPUTE_CHOICES = ("none", "selective", "full")
CP_ATTENTION_CHOICES = ("allgather", "ring")
MIN_CP_CHUNK = 512  # tokens per cp chunk (a rank holds two)


@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    zero: int
    recompute: str
    schedule: str = ""
    virtual: int = 1
    cp: int = 1
    cp_attention: str = "allgather"
    ep: int = 1  # folded over the dp data ranks (does not add devices)
    # ZeRO-1/2 as the distributed optimizer; None: the run did not ask for it (nothing to set)
    flat: bool | None = None
    # --overlap-comm: inductor issues the data axes' collectives once their inputs exist (set on
    # every candidate when the run compiles with inductor, which it needs)
    overlap: bool = False
    memory: int = 0  # peak bytes per device
    step_s: float = 0.0
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    mfu: float = 0.0
    reason: str = ""  # why rejected; empty when it is a valid candidate

    @property
    def mesh(self) -> str:
        return (f"dp={self.dp},tp={self.tp},pp={self.pp}" + (f",cp={self.cp}" if self.cp > 1 else "")
                + (f",ep={self.ep}" if self.ep > 1 else ""))

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        pipe = f", {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "") if self.pp > 1 else ""
        context = f", cp {self.cp_attention}" if self.cp > 1 else ""
        flat = ", distributed optimizer" if self.flat else ""
        return f"{self.mesh}, zero {self.zero}{flat}, recompute {self.recompute}{pipe}{context}"

    def assignments(self) -> list[str]:
        out = [f"parallel.mesh={self.mesh}", f"parallel.zero={self.zero}", f"compute.recompute={self.recompute}",
               f"parallel.sequence_parallel={'true' if self.tp > 1 else 'false'}"]
        if self.pp > 1:
            out += [f"parallel.pipeline_schedule={self.schedule}", f"parallel.virtual_stages={self.virtual}"]
        if self.cp > 1:
            out.append(f"parallel.cp_attention={self.cp_attention}")
        if self.flat is not None:  # asked for: on where it shards (zero 1, 2), off elsewhere
            out.append(f"parallel.distributed_optimizer={'true' if self.flat else 'false'}")
        if self.overlap:
            out.append("parallel.overlap_comm=true")
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_sizes(cfg: RunConfig, devices: int) -> list[int]:
    if not model_for(cfg.model).CONTEXT_PARALLEL:
        return [1]
    return [cp for cp in _divisors(devices) if cfg.train.seq_len // (2 * cp) >= MIN_CP_CHUNK or cp == 1]


def _ep_sizes(cfg: RunConfig, dp: int) -> list[int]:
    moe = model_for(cfg.model).experts(cfg.model)
    if moe is None:
        return [1]
    return [ep for ep in _divisors(dp) if moe.n_experts % ep == 0]


def candidates(cfg: RunConfig, devices: int, profile: DeviceProfile) -> list[Candidate]:
    out = []
    flat = cfg.parallel.distributed_optimizer  # kept for the ZeRO stages it shards (1, 2)
    overlap = cfg.parallel.overlap_comm or (cfg.train.compile and cfg.train.compile_backend == "inductor")
    for cp in _cp_sizes(cfg, devices):
        for tp in _divisors(devices // cp):
            for pp in _divisors(devices // (cp * tp)):
                dp = devices // (cp * tp * pp)
                zeros = (0, 1) if pp > 1 else (0, 1, 2, 3)
                schedules = SCHEDULE_CHOICES if pp > 1 else (("", 1),)
                for ep in _ep_sizes(cfg, dp):
                    for zero in zeros:
                        for recompute in RECOMPUTE_CHOICES:
                            for schedule, virtual in schedules:
                                for mode in CP_ATTENTION_CHOICES if cp > 1 else ("allgather",):
                                    out.append(Candidate(dp, tp, pp, zero, recompute, schedule, virtual, cp, mode,
                                                         ep, flat=zero in (1, 2) if flat else None,
                                                         overlap=overlap))
    return out


def evaluate(cfg: RunConfig, c: Candidate, profile: DeviceProfile, budget: int, plans: dict | None = None) -> Candidate:
    """Fill in ``c``'s memory and step time, or its rejection reason; ``plans`` (layout ->
    plan, shared by the candidates of one search of ``cfg``) saves re-planning a layout."""

    if c.tp > profile.per_node or profile.per_node % c.tp:
        c.reason = (f"tp={c.tp} groups would span nodes ({profile.per_node} devices per node): tp traffic needs "
                    f"NVLink, so tp must divide {profile.per_node}")
        return c
    try:
        run_cfg = override(cfg, c.assignments())
        plans = {} if plans is None else plans
        # not the recompute mode nor the cp attention: the plan does not depend on them
        key = (c.mesh, c.zero, c.schedule, c.virtual, c.flat)
        model = model_for(run_cfg.model)
        if key not in plans:
            plans[key] = run_plan(run_cfg, model)
        plan = plans[key]
        run_cfg.validate(plan.mesh.data_size)
        model.check_mesh(run_cfg.model, plan.mesh)
        check_context_parallel(run_cfg, plan.mesh, model)
        if plan.pipeline is not None:

            check_microbatches(c.schedule, run_cfg.grad_accum_steps(c.dp), c.pp, c.virtual)
    except ConfigError as e:
        c.reason = str(e) if len(str(e)) < 240 else str(e)[:240] + "..."
        return c
    est = estimate_plan(run_cfg, plan)
    c.memory = est.peak
    if c.memory > budget:
        c.reason = f"needs {c.memory / 1e9:.1f} GB per device, over {budget / 1e9:.1f} GB"
        return c
    _price(run_cfg, c, est, profile)
    return c


def _price(cfg: RunConfig, c: Candidate, est: Any, profile: DeviceProfile) -> None:
    t = cfg.train

    specs = model_for(cfg.model).param_specs(cfg.model)
    devices = c.devices
    flops = model_flops_per_token(specs, cfg.model, t.seq_len) * t.global_batch_size * t.seq_len
    factor = {"none": 1.0, "selective": 1.03, "full": 4 / 3}[c.recompute]
    compute = flops * factor / devices / (profile.peak_flops * profile.efficiency)
    tp_bw = profile.intra_bw if c.tp <= profile.per_node else profile.inter_bw
    # ranks: tp fastest, then cp, then the data axes
    cp_bw = profile.intra_bw if c.tp * c.cp <= profile.per_node else profile.inter_bw
    ep_bw = profile.intra_bw if c.tp * c.cp * c.ep <= profile.per_node else profile.inter_bw
    data_bw = profile.intra_bw if c.tp * c.cp * c.dp <= profile.per_node else profile.inter_bw
    pp_bw = profile.intra_bw if devices <= profile.per_node else profile.inter_bw
    traffic = est.traffic
    tp_s = traffic["tp"].bytes_sent / tp_bw if "tp" in traffic else 0.0
    cp_s = traffic["cp"].bytes_sent / cp_bw if "cp" in traffic else 0.0
    # over ep: the experts' all-to-alls; the rest (where dp x ep holds only ep) is gradient traffic
    a2a = traffic["ep"].op_bytes.get("all_to_all", 0.0) if "ep" in traffic else 0.0
    ep_s = a2a / ep_bw
    data_s = (sum(v.bytes_sent for k, v in traffic.items() if k not in ("tp", "pp", "cp")) - a2a) / data_bw
    pp_s = traffic["pp"].bytes_sent / pp_bw if "pp" in traffic else 0.0
    # reordered, a reduction hides behind the backward after its bucket (about 2/3 of the step's
    # compute), a ZeRO-3 gather behind the whole step; in traced order each waits where it is issued
    hidden_behind = (compute if c.zero == 3 else compute * 2 / 3) if c.overlap else 0.0
    exposed = max(0.0, data_s - hidden_behind)
    n_micro = est.work.n_micro
    bubble = (c.pp - 1) / (c.virtual * n_micro) if c.pp > 1 else 0.0
    c.step_s = (compute + tp_s + cp_s + ep_s) * (1 + bubble) + exposed + pp_s
    c.parts = {"compute": compute, "tp": tp_s, "cp": cp_s, "ep": ep_s, "data": data_s, "data exposed": exposed,
               "bubble": bubble, "pp": pp_s}
    c.mfu = flops / devices / c.step_s / profile.peak_flops


def search(cfg: RunConfig, devices: int, profile: DeviceProfile, budget: int | None = None) -> list[Candidate]:
    """Every candidate for ``devices`` devices, evaluated: valid ones first, fastest first."""
    if devices < 1:
        raise ConfigError(f"--devices {devices}: give the number of devices to plan for, e.g. --devices 64")
    budget = budget or profile.memory
    plans: dict = {}
    done = [evaluate(cfg, c, profile, budget, plans) for c in candidates(cfg, devices, profile)]
    ok = sorted((c for c in done if not c.reason), key=lambda c: (c.step_s, c.memory))
    return ok + [c for c in done if c.reason]


def report(cfg: RunConfig, devices: int, profile: DeviceProfile, budget: int | None = None, top: int = 10,
           config_path: str = "...") -> str:
    budget = budget or profile.memory
    found = search(cfg, devices, profile, budget)
    ok = [c for c in found if not c.reason]
    lines = [f"auto plan for {cfg.name} on {devices} x {profile.name} ({budget / 1e9:.0f} GB, "
             f"{profile.peak_flops / 1e12:.0f} TFLOP/s x {profile.efficiency:.0%}, NVLink {profile.intra_bw / 1e9:.0f} "
             f"GB/s, network {profile.inter_bw / 1e9:.0f} GB/s, {profile.per_node} per node); global batch "
             f"{cfg.train.global_batch_size} x {cfg.train.seq_len} tokens, micro batch {cfg.train.micro_batch_size}",
             f"{len(found)} candidates, {len(ok)} fit and divide"]
    rows = [("#", "layout", "memory/device", "step s", "MFU", "compute", "tp", "cp", "ep", "data (exposed)",
             "bubble")]
    for i, c in enumerate(ok[:top], 1):
        p = c.parts
        rows.append((str(i), c.describe(), f"{c.memory / 1e9:.1f} GB", f"{c.step_s:.3f}", f"{c.mfu:.0%}",
                     f"{p['compute']:.3f}", f"{p['tp']:.3f}", f"{p['cp']:.3f}", f"{p['ep']:.3f}",
                     f"{p['data']:.3f} ({p['data exposed']:.3f})",
                     f"{p['bubble']:.0%}"))

    lines += text_table(rows) if ok else ["  no candidate fits: more devices, more memory per device, or a smaller "
                                      "micro batch / sequence"]
    if ok:
        best = ok[0]
        sets = " ".join(f"--set {a}" for a in best.assignments())
        lines.append(f"best: python run.py --config {config_path} [your other flags] {sets}")
    lines.append("rejected (by layout; a layout is shown once with the reason of its best setting):")
    seen: dict[str, Candidate] = {}
    for c in found:
        if c.reason and c.mesh not in {o.mesh for o in ok}:
            prev = seen.get(c.mesh)
            if prev is None or (c.memory and (not prev.memory or c.memory < prev.memory)):
                seen[c.mesh] = c
    for mesh, c in seen.items():
        tried = sum(1 for o in found if o.mesh == mesh)
        best_note = f" (lowest: zero {c.zero}, recompute {c.recompute})" if c.memory else ""
        lines.append(f"  {mesh}: {c.reason}{best_note} [{tried} settings]")
    partial = sum(1 for c in found if c.reason and c.mesh in {o.mesh for o in ok})
    if partial:
        lines.append(f"  ... and {partial} settings of the listed layouts (zero/recompute/schedule) that do not fit")
    return "\n".join(lines)
