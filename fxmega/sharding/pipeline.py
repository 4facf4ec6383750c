"""Pipeline stages cut from the layer stack: which stage holds the embedding, which blocks
and the head, which pp rank runs each stage, and the schedule that orders their work.

Pure data (no process group), so a plan for any mesh can be made and printed anywhere.

- ``pp × virtual`` stages. By default they are balanced by estimated cost: a block costs
  its parameter count, the head its vocabulary projection (a GPT-2 head costs ~4 blocks),
  and the embedding lookup almost nothing. This is the same accounting as Megatron-LM's
  ``--account-for-embedding/loss-in-pipeline-split``, done by a min-max partition.
- ``--pipeline-layout`` overrides the split in Megatron-LM's notation: stages separated
  by ``|``, each a list of ``E`` (embedding), ``t`` (a transformer block, ``t*3`` for
  three) and ``L`` (the head and loss), e.g. ``"Et*3|t*4|t*3L"``.
- Stage ``s`` runs on pp rank ``s % pp`` (Megatron's interleaving).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fxmega.core.errors import ConfigError

# name -> (torch.distributed.pipelining class, stages per rank: "one" | "many")
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "one"),
    "1f1b": ("Schedule1F1B", "one"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "many"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", "many"),
}
# ScheduleZBVZeroBubble (the V-shaped zero-bubble schedule) trains here but its eval()
# fails inside torch 2.13 ("can't steal_bwd_input if this stage doesn't have backward"),
# so fxmega offers the interleaved zero-bubble schedule, which does both.
# schedules that split the backward into input and weight gradients: they walk the
# autograd graph of the stage, which a compiled stage hides (torch raises for them)
SPLIT_BACKWARD = ("zero-bubble",)


@dataclass(frozen=True)
class Stage:
    index: int
    rank: int  # pp rank that runs it
    embed: bool
    blocks: tuple[int, ...]
    head: bool

    def params_of(self, local: dict, embed_groups: tuple[str, ...], head_groups: tuple[str, ...]) -> dict:
        """The part of a pp rank's parameter tree (blocks keyed by global index) that this
        stage reads: the same tensors, not copies."""
        out = {g: local[g] for g in embed_groups} if self.embed else {}
        out["blocks"] = {str(i): local["blocks"][str(i)] for i in self.blocks}
        if self.head:
            out.update({g: local[g] for g in head_groups})
        return out

    def describe(self) -> str:
        parts = (["E"] if self.embed else []) + \
            ([f"blocks {self.blocks[0]}-{self.blocks[-1]}" if len(self.blocks) > 1 else f"block {self.blocks[0]}"]
             if self.blocks else []) + (["L"] if self.head else [])
        return ", ".join(parts) or "(empty)"


@dataclass(frozen=True)
class PipelineLayout:
    pp: int
    virtual: int
    schedule: str
    stages: tuple[Stage, ...]
    costs: tuple[float, ...] = ()  # per stage, in units of one block

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stages_of(self, rank: int) -> list[Stage]:
        return [s for s in self.stages if s.rank == rank]

    def owns(self, rank: int, path: str, embed_groups: tuple[str, ...], head_groups: tuple[str, ...]) -> bool:
        """Whether pp rank ``rank`` holds parameter ``path`` (a tied embedding is held by
        the first and the last stage's ranks)."""
        top = path.split(".")[0]
        for s in self.stages_of(rank):
            if top == "blocks" and int(path.split(".")[1]) in s.blocks:
                return True
            if (s.embed and top in embed_groups) or (s.head and top in head_groups):
                return True
        return False

    def owners(self, path: str, embed_groups: tuple[str, ...], head_groups: tuple[str, ...]) -> list[int]:
        return [r for r in range(self.pp) if self.owns(r, path, embed_groups, head_groups)]

    def describe(self) -> list[str]:
        out = [f"pipeline: {self.pp} ranks x {self.virtual} virtual = {self.n_stages} stages, schedule {self.schedule}"]
        for s in self.stages:
            cost = f"  (cost {self.costs[s.index]:.2f} blocks)" if self.costs else ""
            out.append(f"  stage {s.index} on pp rank {s.rank}: {s.describe()}{cost}")
        return out


def stage_rank(stage: int, pp: int) -> int:
    return stage % pp


def check_schedule(schedule: str, pp: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[schedule][1]
    if virtual < 1:
        raise ConfigError(f"--virtual-stages {virtual} must be at least 1")
    if kind == "one" and virtual != 1:
        raise ConfigError(f"the {schedule} schedule runs one stage per rank, but --virtual-stages is {virtual}; "
                          f"use --pipeline-schedule interleaved-1f1b for virtual stages")
    if schedule == "interleaved-1f1b" and virtual < 2:
        raise ConfigError("interleaved-1f1b needs --virtual-stages 2 or more (with 1 it is plain 1f1b)")


def check_microbatches(schedule: str, n_micro: int, pp: int, virtual: int) -> None:
    """The microbatch counts each schedule accepts, checked before torch would fail deep
    inside the schedule's constructor."""
    fix = (f"set --global-batch-size to micro batch x data-parallel size x a valid count (e.g. "
           f"{max(pp, n_micro + (-n_micro) % pp)} microbatches)")
    if schedule in ("1f1b", "interleaved-1f1b", "zero-bubble") and n_micro < pp:
        raise ConfigError(f"the {schedule} schedule needs at least pp={pp} microbatches per step, but the batch gives "
                          f"{n_micro}: {fix}")
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise ConfigError(f"the {schedule} schedule runs microbatches in rounds of pp={pp}; {n_micro} "
                              f"microbatches do not split into {rounds} equal rounds: use a multiple of {pp}")


def parse_layout(text: str, n_stages: int, n_layers: int) -> list[tuple[bool, int, bool]]:
    """``"Et*3|t*4|t*3L"`` → per stage (has embedding, number of blocks, has head)."""
    stages = []
    for i, part in enumerate(text.replace(" ", "").replace(",", "").split("|")):  # commas only for reading
        tokens = re.findall(r"E|L|t(?:\*\d+)?|.", part)
        bad = [t for t in tokens if not re.fullmatch(r"E|L|t(\*\d+)?", t)]
        if bad:
            raise ConfigError(f"--pipeline-layout {text!r}: stage {i} has {bad[0]!r}; a stage is a list of E "
                              f"(embedding), t or t*N (blocks) and L (head and loss), stages separated by |")
        n = sum(int(t[2:]) if t.startswith("t*") else 1 for t in tokens if t.startswith("t"))
        stages.append(("E" in tokens, n, "L" in tokens))
    if len(stages) != n_stages:
        raise ConfigError(f"--pipeline-layout {text!r} has {len(stages)} stages; pp x virtual stages = {n_stages}")
    if sum(n for _, n, _ in stages) != n_layers:
        raise ConfigError(f"--pipeline-layout {text!r} places {sum(n for _, n, _ in stages)} blocks; the model has "
                          f"{n_layers}")
    if not stages[0][0] or any(e for e, _, _ in stages[1:]):
        raise ConfigError(f"--pipeline-layout {text!r}: the embedding E must be in the first stage, and only there")
    if not stages[-1][2] or any(h for _, _, h in stages[:-1]):
        raise ConfigError(f"--pipeline-layout {text!r}: the head L must be in the last stage, and only there")
    return stages


def balanced_counts(n_layers: int, n_stages: int, embed_cost: float, head_cost: float) -> list[int]:
    """Blocks per stage (each at least one) minimising the most expensive stage, the first
    stage also paying for the embedding and the last for the head; among splits with the
    same maximum, the most even one (least sum of squared stage costs)."""
    if n_stages > n_layers:
        raise ConfigError(f"{n_stages} pipeline stages need at least {n_stages} blocks, but the model has {n_layers}: "
                          f"lower pp or --virtual-stages, or give empty stages with --pipeline-layout")
    best: dict[tuple[int, int], tuple[tuple[float, float], list[int]]] = {}

    def solve(stage: int, start: int) -> tuple[tuple[float, float], list[int]]:
        # the best split of blocks [start, n_layers) over stages [stage, n_stages)
        if (stage, start) in best:
            return best[(stage, start)]
        left = n_stages - stage
        extra = embed_cost if stage == 0 else 0.0
        if left == 1:
            cost = n_layers - start + head_cost + extra
            result = ((cost, cost * cost), [n_layers - start])
        else:
            result = ((float("inf"), float("inf")), [])
            for n in range(1, n_layers - start - (left - 1) + 1):
                (rest_max, rest_sq), counts = solve(stage + 1, start + n)
                key = (round(max(n + extra, rest_max), 9), round((n + extra) ** 2 + rest_sq, 9))
                if key < result[0]:
                    result = (key, [n] + counts)
        best[(stage, start)] = result
        return result

    return solve(0, 0)[1]


def make_pipeline(n_layers: int, pp: int, virtual: int, schedule: str, layout: str, embed_cost: float,
                  head_cost: float) -> PipelineLayout:
    check_schedule(schedule, pp, virtual)
    n_stages = pp * virtual
    if layout:
        shape = parse_layout(layout, n_stages, n_layers)
    else:
        shape = [(i == 0, n, i == n_stages - 1)
                 for i, n in enumerate(balanced_counts(n_layers, n_stages, embed_cost, head_cost))]
    stages, first, costs = [], 0, []
    for i, (embed, n, head) in enumerate(shape):
        stages.append(Stage(i, stage_rank(i, pp), embed, tuple(range(first, first + n)), head))
        costs.append(n + (embed_cost if embed else 0) + (head_cost if head else 0))
        first += n
    return PipelineLayout(pp, virtual, schedule, tuple(stages), tuple(costs))
