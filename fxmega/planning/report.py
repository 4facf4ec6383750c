"""``run.py plan``: everything a run on this mesh would do, printed before a cluster hour is
spent — the resolved mesh and its rank layout, the per-parameter sharding table and
pipeline stage map, per-rank memory by kind against ``--memory-per-device`` with a verdict,
and communication per step per mesh axis. The plan is checked on the real DeviceMesh and
DTensors, built on torch's fake process group (``fxmega.planning.fake``); with ``--rank r``
that rank's whole step is also traced and its collectives listed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fxmega.compiler.kernel_dump import dump_kernels
from fxmega.config import RunConfig
from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models import family_name, model_for
from fxmega.models.weight_uses import fp8_gathered
from fxmega.optim.matrices import matrix_view
from fxmega.optim.optimizer import optimizer_for
from fxmega.parallel.strategy import run_plan
from fxmega.planning import estimate, exposure, fake
from fxmega.planning.devices import PROFILES, DeviceProfile
from fxmega.planning.traffic import AxisTraffic, communication, orthogonalised_here, whole_matrix_minimum
from fxmega.sharding.mesh import PHYSICAL_ORDER, MeshSpec
from fxmega.sharding.pipeline import SPLIT_BACKWARD
from fxmega.sharding.plan import ShardingPlan, format_bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``80GB`` (10^9 bytes per GB, as GPU data sheets count), ``80GiB`` (2^30), ``8e10``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"--memory-per-device {text!r}: write a size like 80GB, 141GB, 24GiB or 8e10 (bytes)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"--memory-per-device {text!r} must be more than zero")
    return int(value)


@dataclass
class PlanEstimate:
    """The estimates of one plan: memory per pp rank and traffic per axis (of pp rank 0 and
    of every pp rank for the pipeline's own traffic)."""

    plan: ShardingPlan
    work: estimate.Workload
    memory: list[estimate.MemoryEstimate]
    traffic: dict[str, AxisTraffic]
    # bytes a rank would send to make its sliced hidden matrices whole under the owner scheme
    # (an optimizer that updates whole matrices; 0 otherwise): what muon_all_gather compares to
    matrix_minimum: float = 0.0

    @property
    def peak(self) -> int:
        return max(m.total for m in self.memory)


def estimate_plan(cfg: RunConfig, plan: ShardingPlan) -> PlanEstimate:

    work = estimate.workload_of(cfg, plan.mesh.data_size)
    mem = estimate.memory(plan, cfg.model, work)
    matrices = {}
    if optimizer_for(cfg.optim).whole_matrices:
        specs = model_for(cfg.model).param_specs(cfg.model)
        matrices = {path: view for path, view in zip(tree.paths(specs), map(matrix_view, tree.leaves(specs)))
                    if view is not None}
    mine = [p for p in plan.params.values() if 0 in plan.pp_owners(p.path)]
    in_fp8 = fp8_gathered(cfg.model, plan.tp_shapes()) if cfg.compute.fp8_gather else frozenset()
    return PlanEstimate(plan, work, mem, communication(plan, cfg.model, work, cfg.parallel.bucket_size,
                                                       matrices=matrices, fp8_gathered=in_fp8),
                        whole_matrix_minimum(plan, mine, orthogonalised_here(plan, mine, matrices,
                                                                             cfg.parallel.bucket_size)))


def rank_layout(mesh: MeshSpec, limit: int = 8) -> list[str]:
    """How ranks are numbered and which ranks form each axis' groups (first few)."""
    lines = [f"mesh: {mesh.describe()}; rank = " + " + ".join(
        f"{a}*{_stride(mesh, a)}" if _stride(mesh, a) > 1 else a for a in mesh.names) + " (tp fastest, pp slowest)"]
    for axis in mesh.names:
        groups = _groups(mesh, axis)
        shown = ", ".join("[" + _ranks(g) + "]" for g in groups[:3]) + (" ..." if len(groups) > 3 else "")
        lines.append(f"  {axis} groups ({len(groups)} of {mesh.size(axis)} ranks): {shown}")
    lines.append(mesh.rank_table(limit))
    return lines


def _stride(mesh: MeshSpec, axis: str) -> int:
    names = list(mesh.names)
    stride = 1
    for a in reversed(names[names.index(axis) + 1:]):
        stride *= mesh.size(a)
    return stride


def _groups(mesh: MeshSpec, axis: str) -> list[list[int]]:
    by_key: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        by_key.setdefault(tuple(c[a] for a in PHYSICAL_ORDER if a != axis), []).append(r)
    return list(by_key.values())


def _ranks(group: list[int]) -> str:
    if len(group) > 2 and all(b - a == group[1] - group[0] for a, b in zip(group, group[1:])):
        step = group[1] - group[0]
        return f"{group[0]}..{group[-1]}" + (f" step {step}" if step > 1 else "")
    return ",".join(map(str, group))


def memory_table(est: PlanEstimate, budget: int | None) -> list[str]:
    w = est.work
    lines = [f"memory per rank (micro batch {w.micro_batch} x seq {w.seq_len}, {w.n_micro} micro batch(es) per step, "
             f"{w.precision}, recompute {w.recompute}; fp32 masters and AdamW state)"]
    rows = [("pp rank", "blocks", "params", "grads", "AdamW", "compute copy", "activations", "transient", "total")]
    for m in est.memory:
        rows.append((str(m.pp_rank), str(m.blocks), *map(format_bytes, (m.params, m.grads, m.opt, m.compute_copy)),
                     f"{format_bytes(m.activations)} ({m.in_flight:g} mb)", format_bytes(m.transient),
                     format_bytes(m.total)))
    lines += text_table(rows)
    worst = max(est.memory, key=lambda m: m.total)
    if budget is None:
        lines.append(f"peak {format_bytes(worst.total)} on pp rank {worst.pp_rank} (give --memory-per-device for a "
                     f"verdict)")
    elif worst.total <= budget:
        lines.append(f"fits: peak {format_bytes(worst.total)} on pp rank {worst.pp_rank} is "
                     f"{100 * worst.total / budget:.0f}% of {format_bytes(budget)} per device")
    else:
        lines.append(f"OOM: pp rank {worst.pp_rank} needs {format_bytes(worst.total)} but a device has "
                     f"{format_bytes(budget)} ({format_bytes(worst.total - budget)} over). " + _advice(est, worst))
    return lines


def _advice(est: PlanEstimate, m: estimate.MemoryEstimate) -> str:
    """The biggest item first, and what shrinks it."""
    items = {"activations": m.activations + m.transient, "AdamW state": m.opt, "gradients": m.grads,
             "parameters": m.params + m.compute_copy}
    big = max(items, key=items.get)
    fixes = {"activations": "--recompute selective or full, a smaller --micro-batch-size, --sequence-parallel, or "
                            "more tp",
             "AdamW state": "--zero 1 (shard it over dp), or more tp/pp",
             "gradients": "--zero 2, or more tp/pp",
             "parameters": "--zero 3, or more tp/pp"}
    return f"Largest: {big} ({format_bytes(items[big])}); try {fixes[big]} — or --mesh auto to search"


def traffic_table(est: PlanEstimate) -> list[str]:
    if not est.traffic:
        return ["communication: none (one device)"]
    lines = ["communication per step, pp rank 0 (bytes each rank sends, ring algorithms):"]
    rows = [("axis", "bytes/step", "collectives", "of which")]
    for axis, t in est.traffic.items():
        rows.append((axis, format_bytes(t.bytes_sent), str(t.collectives),
                     ", ".join(f"{op} x{n}" for op, n in sorted(t.ops.items()))))
    lines += text_table(rows)
    gathered = sum(t.op_bytes.get("muon_all_gather", 0.0) for t in est.traffic.values())
    if gathered:
        lines.append(f"  muon_all_gather: the sliced hidden matrices gathered whole for Newton-Schulz, "
                     f"{format_bytes(gathered)}; the least any scheme sends (each matrix to one owner rank and "
                     f"back) is {format_bytes(est.matrix_minimum)}")
    in_fp8 = sum(t.op_bytes.get("all_gather_fp8", 0.0) for t in est.traffic.values())
    if in_fp8:
        precision = est.work.precision
        lines.append(f"  all_gather_fp8: the fp8 recipe's weights gathered as e4m3 bytes with their scales, "
                     f"{format_bytes(in_fp8)}; in {precision} they would be "
                     f"{format_bytes(in_fp8 * estimate.DTYPE_BYTES[precision])}")
    return lines


def text_table(rows: list[tuple]) -> list[str]:
    """Rows of strings as aligned columns, the first row a header underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, r in enumerate(rows):
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def plan_report(cfg: RunConfig, budget: int | None = None, rank: int | None = None, verify: bool = True,
                dump_dir: str | None = None, profile: DeviceProfile = PROFILES["h100"]) -> str:
    """The ``run.py plan`` text for ``cfg`` (its ``parallel.mesh``), optionally tracing ``rank``
    (and writing its traced graphs under ``dump_dir``, see ``fxmega.compiler.kernel_dump``) and
    replaying its collectives at ``profile``'s rates (``fxmega.planning.exposure``)."""

    model = model_for(cfg.model)
    plan = run_plan(cfg, model)
    cfg.validate(plan.mesh.data_size)
    lines = rank_layout(plan.mesh) + [""] + _collapse_blocks(plan.explain().splitlines(), cfg.model.n_layers)
    if not estimate.declares_saved(cfg.model):
        lines += ["", f"memory and communication: not estimated, the {family_name(cfg.model)} family declares no "
                      f"BLOCK_SAVED (what a block keeps for its backward); the parameter and optimizer bytes per rank "
                      f"are above, and --rank R traces a rank's step and counts its collectives"]
    else:
        est = estimate_plan(cfg, plan)
        lines += [""] + memory_table(est, budget)
        lines += [""] + traffic_table(est)
    if verify or rank is not None:
        lines += [""] + _on_fake_mesh(cfg, plan, rank, profile, dump_dir)
    return "\n".join(lines)


def _collapse_blocks(lines: list[str], n_layers: int) -> list[str]:
    """The sharding table with the first block of each kind standing for the blocks laid out
    alike (all of them in most models; T5's decoder blocks differ from its encoder's); the
    stage map says which pp rank holds which block. ``n_layers`` is kept for the callers."""
    def block(line: str) -> int | None:
        m = re.match(r"blocks\.(\d+)\.", line)
        return None if m is None else int(m.group(1))

    rows: dict[int, list[tuple[str, ...]]] = {}
    for line in lines:
        if block(line) is not None:
            # the stage ("@ pp N") aside: the stage map says which pp rank holds which block
            rows.setdefault(block(line), []).append(tuple(re.sub(r"^blocks\.\d+\.|@ pp \S+", "", line).split()))
    first: dict[tuple, int] = {}
    like = {i: first.setdefault(tuple(r), i) for i, r in sorted(rows.items())}
    out: list[str] = []
    run: list[int] = []  # [first, last, like] of blocks not shown

    def flush() -> None:
        if run:
            a, b, j = run
            out.append(f"blocks.{a} .. blocks.{b}: laid out as blocks.{j}" if b > a else
                       f"blocks.{a}: laid out as blocks.{j}")
            run.clear()

    for line in lines:
        i = block(line)
        if i is None or like[i] == i:
            if i is None or not run or run[1] < i:
                flush()
            out.append(line)
        elif run and run[2] == like[i] and run[1] in (i, i - 1):
            run[1] = i
        else:
            flush()
            run.extend([i, i, like[i]])
    flush()
    return out


def _on_fake_mesh(cfg: RunConfig, plan: ShardingPlan, rank: int | None, profile: DeviceProfile,
                  dump_dir: str | None = None) -> list[str]:
    import contextlib


    who = 0 if rank is None else rank
    with fake.fake_world(plan.mesh.world_size, who):
        par = fake.fake_parallel(cfg, who)
        n = fake.check_placements(par)
        lines = [f"checked on a fake {plan.mesh.world_size}-rank process group: rank {who}'s {len(par.shards.layouts)} "
                 f"parameters as DTensors over the mesh ({n} param/grad/opt layouts), shapes as planned"]
        if rank is None:
            return lines
        dumping = dump_kernels(dump_dir, rank, par.groups.labels) if dump_dir else contextlib.nullcontext()
        with dumping:
            trace = fake.trace_rank_step(cfg, par)
        if dump_dir:
            lines.append(f"wrote {dump_dir}/rank{rank}/: the traced FX graphs (aot_eager on meta tensors: no kernels; "
                         f"a real run with --dump-kernels adds inductor's code) and index.md")
    coords = ", ".join(f"{a}={c}" for a, c in plan.mesh.coords(rank).items() if a in plan.mesh.names)
    lines.append(f"rank {rank} ({coords}): step traced on meta tensors in {trace.seconds:.1f} s, "
                 f"{len(trace.graphs)} graph(s); collectives:")
    pipe = plan.pipeline
    if pipe is not None and not trace.graphs:

        if pipe.schedule in SPLIT_BACKWARD:
            lines.append(f"  none traced: the {pipe.schedule} schedule runs its stages eagerly (it splits each "
                         f"backward by walking the stage's autograd graph, which compiling would hide)")
            return lines
    seconds = exposure.link_seconds(plan.mesh, rank, trace.labels, profile)
    rate = profile.peak_flops * profile.efficiency
    replays = {moved: [t for g in trace.graphs for t in exposure.replay(g, seconds, rate, moved)]
               for moved in (False, True)}
    timed: dict[tuple[str, str], list[float]] = {}
    for traced, moved in zip(replays[False], replays[True]):
        c = traced.collective
        row = timed.setdefault((trace.labels.get(c.group, c.group), c.op), [0.0, 0.0, 0.0])
        row[0] += traced.seconds
        row[1] += traced.exposed_s
        row[2] += moved.exposed_s
    rows = [("axis", "op", "count", "bytes (inputs)", "nothing before wait", "GFLOP before waits", "transfer ms",
             "exposed ms traced", "exposed ms overlapped")]
    overlap = trace.overlap_by_axis()
    for axis, ops in sorted(trace.by_axis().items()):
        for op, (count, size) in sorted(ops.items()):
            bare, flops = overlap[axis][op]
            took, traced_s, moved_s = timed[(axis, op)]
            rows.append((axis, op, str(count), format_bytes(size), str(bare), f"{flops / 1e9:.3g}",
                         f"{took * 1e3:.3g}", f"{traced_s * 1e3:.3g}", f"{moved_s * 1e3:.3g}"))
    if len(rows) == 1:
        return lines + ["  none"]
    total = sum(t.seconds for t in replays[False])
    exposed = {moved: sum(t.exposed_s for t in replays[moved]) for moved in (False, True)}
    on = "on" if cfg.parallel.overlap_comm else "off"
    note = ["  (compute between each collective and its wait, in the order the graphs were traced: what it "
            "can hide behind; 'nothing' means exposed unless a scheduler moves it)",
            f"exposed communication per step (one micro batch), replayed at {profile.name}'s rates "
            f"({rate / 1e12:.0f} TFLOP/s of matmuls, {profile.intra_bw / 1e9:.0f} GB/s in a node, "
            f"{profile.inter_bw / 1e9:.0f} GB/s across): {exposed[False] * 1e3:.3g} ms of {total * 1e3:.3g} ms in "
            f"traced order, {exposed[True] * 1e3:.3g} ms with each collective issued once its inputs exist and "
            f"waited for at first use (--overlap-comm, {on} in this config; fxmega.planning.exposure)"]
    return lines + text_table(rows) + note
