"""The sharding planner: a spec tree + rules + mesh → a ``ShardingPlan``.

For every parameter the plan says which dim is split over tp (``tp_dim``), which dim is
split over the data axes (``zero_dim``, the ``embed`` dim) and over which data axes the
stored parameter, its gradient and its optimizer state are split. It validates the rules
against the specs with errors that name the parameter, the dim, the axis and the fix, pads
a vocabulary that tp does not divide, gives the DTensor placements on the full mesh, the
local shapes, and a per-rank memory table (``explain``).

The plan is pure data: it needs no process group, so it can be made and printed for any
mesh on one machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.core.spec import ParamSpec
from fxmega.sharding.mesh import DATA_AXES, PHYSICAL_ORDER, MeshSpec
from fxmega.sharding.pipeline import PipelineLayout
from fxmega.sharding.rules import LOGICAL_AXES, Strategy, mesh_axes_of

KINDS = ("param", "grad", "opt")
# the masters and their gradients are fp32 (compute may be bf16 or fp16; ``core.precision``)
MASTER_DTYPE = torch.float32
# AdamW: two fp32 moments per parameter element (the optimizer declares its own: ``optim.optimizer``)
ADAMW_STATE_BYTES = 8


@dataclass(frozen=True)
class ParamLayout:
    path: str
    shape: tuple[int, ...]  # global shape (vocab dims padded to a multiple of tp)
    axes: tuple[str, ...]
    tp_dim: int | None
    zero_dim: int | None
    data_axes: dict[str, tuple[str, ...]]  # kind -> data axes splitting zero_dim
    tp_size: int
    data_sizes: dict[str, int] = field(default_factory=dict)  # data axis -> size
    ep_dim: int | None = None  # the experts' dim, split over ep (each ep rank its own experts)

    @property
    def ep_size(self) -> int:
        return self.data_sizes.get("ep", 1) if self.ep_dim is not None else 1

    def data_split(self, kind: str) -> int:
        return math.prod(self.data_sizes[a] for a in self.data_axes[kind])

    def replica_axes(self, data_axes: tuple[str, ...]) -> tuple[str, ...]:
        """Of the mesh's ``data_axes``, those over which this parameter's (optimizer-layout)
        gradient is summed: not the ones sharding its optimizer state, and not ep for an
        expert (an expert's gradient reaches its own ep rank from every ep rank's tokens
        through the all-to-all's backward, already summed)."""
        split = set(self.data_axes["opt"]) | ({"ep"} if self.ep_dim is not None else set())
        return tuple(a for a in data_axes if a not in split)

    def local_shape(self, kind: str = "param") -> tuple[int, ...]:
        shape = list(self.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] //= self.tp_size
        if self.ep_dim is not None:
            shape[self.ep_dim] //= self.ep_size
        if self.zero_dim is not None:
            shape[self.zero_dim] //= self.data_split(kind)
        return tuple(shape)

    def local_numel(self, kind: str = "param") -> int:
        return math.prod(self.local_shape(kind))

    def placement_names(self, kind: str, mesh: MeshSpec) -> list[str]:
        """Per mesh axis: ``S(d)`` (split along dim d) or ``R`` (replicated)."""
        out = []
        for axis in mesh.names:
            if axis == "tp" and self.tp_dim is not None:
                out.append(f"S({self.tp_dim})")
            elif axis == "ep" and self.ep_dim is not None:
                out.append(f"S({self.ep_dim})")
            elif axis in self.data_axes[kind]:
                out.append(f"S({self.zero_dim})")
            else:
                out.append("R")
        return out

    def data_index(self, kind: str, coords: dict[str, int]) -> int:
        """Which slice of ``zero_dim`` a rank holds: data axes in physical order, the first
        slowest (the nesting DTensor uses for several mesh axes on one dim)."""
        index = 0
        for axis in self.data_axes[kind]:
            index = index * self.data_sizes[axis] + coords[axis]
        return index


@dataclass
class ShardingPlan:
    mesh: MeshSpec
    strategy: Strategy
    params: dict[str, ParamLayout]
    vocab_size: int = 0
    padded_vocab_size: int = 0
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineLayout | None = None
    embed_groups: tuple[str, ...] = ()  # the model's EMBED_PARAMS / HEAD_PARAMS (for stage ownership)
    head_groups: tuple[str, ...] = ()
    master_dtype: torch.dtype = MASTER_DTYPE  # of the parameters and their gradients
    opt_state_bytes: int = ADAMW_STATE_BYTES  # the optimizer's state per parameter element
    _owners: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter (and gradient) element: the master dtype's."""
        return self.master_dtype.itemsize

    def tp_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape as tp leaves it: the slice a ZeRO-3 piece gathers whole and
        multiplies (padded, as ``ParamLayout.shape``)."""
        out = {}
        for lay in self.params.values():
            shape = list(lay.shape)
            if lay.tp_dim is not None:
                shape[lay.tp_dim] //= lay.tp_size
            out[lay.path] = tuple(shape)
        return out

    def pp_owners(self, path: str) -> list[int]:
        """The pp ranks that hold parameter ``path`` (all of them: [0] without pp)."""
        if self.pipeline is None:
            return [0]
        if path not in self._owners:  # asked per parameter per pp rank by the estimates: remember
            self._owners[path] = self.pipeline.owners(path, self.embed_groups, self.head_groups)
        return self._owners[path]

    @property
    def tp(self) -> int:
        return self.mesh.size("tp")

    @property
    def zero(self) -> int:
        return self.strategy.zero

    @property
    def gathers_params(self) -> bool:
        """Whether parameters are stored split over data axes and gathered per piece (ZeRO-3 / fsdp)."""
        return any(lay.data_axes["param"] for lay in self.params.values())

    @property
    def sequence_parallel(self) -> bool:
        return "tp" in mesh_axes_of(self.strategy.rules.get("seq")) and self.tp > 1

    def activation_tp_dims(self, axes: tuple[str | None, ...]) -> int | None:
        """The dim of an activation split over tp, or None (replicated over tp)."""
        rules = self.strategy.rules
        dims = [i for i, name in enumerate(axes) if name is not None and "tp" in mesh_axes_of(rules.get(name))]
        if len(dims) > 1:
            raise ConfigError(f"activation axes {axes} put the tp axis on dims {dims}: a mesh axis can split only one "
                              f"dim of a tensor; map one of {[axes[d] for d in dims]} to None in the rules")
        return dims[0] if dims and self.tp > 1 else None

    def bytes_per_rank(self, pp_rank: int = 0) -> dict[str, int]:
        """Parameter, gradient and optimizer bytes on a rank (of pipeline rank ``pp_rank``)."""
        mine = [p for p in self.params.values() if pp_rank in self.pp_owners(p.path)]
        numel = {kind: sum(p.local_numel(kind) for p in mine) for kind in KINDS}
        if self.strategy.flat:  # 1/n of each tensor's n replicas (up to a bucket's padding of < n elements)
            data_axes = tuple(a for a in DATA_AXES if self.mesh.size(a) > 1)
            split = [math.prod(self.mesh.size(a) for a in p.replica_axes(data_axes)) for p in mine]
            numel["opt"] = sum(-(-p.local_numel("opt") // n) for p, n in zip(mine, split))
            if self.zero >= 2:  # the accumulated gradient too
                numel["grad"] = numel["opt"]
        per_element = {"param": self.param_bytes, "grad": self.param_bytes, "opt": self.opt_state_bytes}
        return {kind: numel[kind] * per_element[kind] for kind in KINDS}

    def explain(self) -> str:
        return explain(self)


def make_plan(specs: tree.Tree, mesh: MeshSpec, strategy: Strategy, pipeline: PipelineLayout | None = None,
              model_groups: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
              opt_state_bytes: int = ADAMW_STATE_BYTES) -> ShardingPlan:
    """Validate ``strategy`` against the specs and mesh and lay out every parameter; with
    pp > 1, ``pipeline`` says which stage (and pp rank) holds what, and ``model_groups``
    the model's embedding and head parameter groups."""
    rules, zero = strategy.rules, strategy.zero
    leaves = list(tree.items(specs))
    known = {a for _, s in leaves for a in s.axes} | set(LOGICAL_AXES)
    for name, rule in rules.items():
        if name == "batch":
            raise ConfigError(f"rules map 'batch' to {rule!r}: the batch is always split over the mesh's data axes "
                              f"(dp, fsdp; each data rank reads its own micro batches) and over nothing else, so it "
                              f"has no rule: remove 'batch' from the rules")
        if name == "ctx" or "cp" in mesh_axes_of(rule):
            raise ConfigError(f"rules map {name!r} to {rule!r}: context parallelism splits the sequence (seq, and "
                              f"ctx inside blocks) over cp by construction and never a parameter, so cp and ctx "
                              f"have no rules: remove them and put cp in --mesh")
        if name not in known:
            raise ConfigError(f"rules name the logical axis {name!r}, which no parameter or activation has; "
                              f"known names: {', '.join(sorted(known))}")
        for axis in mesh_axes_of(rule):
            if axis not in PHYSICAL_ORDER:
                raise ConfigError(f"rule {name!r}: {rule!r} names the mesh axis {axis!r}, which does not exist; "
                                  f"mesh axes are {', '.join(PHYSICAL_ORDER)}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {zero}: use 0, 1, 2 or 3")
    if strategy.flat and zero not in (1, 2):
        raise ConfigError(f"the distributed optimizer shards optimizer state (ZeRO-1) and gradients (ZeRO-2) over "
                          f"flat buffers; with zero {zero} there is nothing for it to shard"
                          + (": use --zero 1 or 2" if zero == 0 else ": ZeRO-3 shards parameters along their embed "
                             "dim; use --zero 1 or 2 with it, or ZeRO-3 without it"))
    if strategy.flat and zero == 2 and mesh.size("pp") > 1:
        raise ConfigError(f"pp={mesh.size('pp')} with zero 2: the pipeline schedule accumulates gradients over "
                          f"microbatches inside the stage, so they cannot be reduce-scattered per microbatch. "
                          f"Use --zero 1 with the distributed optimizer (Megatron's layout with pp)")
    if mesh.size("pp") > 1 and pipeline is None:
        raise ConfigError(f"mesh {mesh.describe()} has pp={mesh.size('pp')} but no stage split was given")
    tp = mesh.size("tp")
    data_sizes = {a: mesh.size(a) for a in DATA_AXES}
    vocab = next((s.shape[s.axes.index("vocab")] for _, s in leaves if "vocab" in s.axes), 0)
    vocab_split = "tp" in mesh_axes_of(rules.get("vocab"))
    padded_vocab = -(-vocab // tp) * tp if vocab and vocab_split else vocab
    plan = ShardingPlan(mesh, strategy, {}, vocab, padded_vocab, pipeline=pipeline, embed_groups=model_groups[0],
                        head_groups=model_groups[1], opt_state_bytes=opt_state_bytes)
    if padded_vocab != vocab:
        plan.notes.append(f"vocab {vocab:,} padded to {padded_vocab:,} so that tp={tp} divides it; "
                          f"the padded logits are masked out of the loss")
    for path, spec in leaves:
        # the distributed optimizer shards flat buffers, not dims: every tensor keeps its rule layout
        plan.params[path] = _layout(path, spec, rules, 0 if strategy.flat else zero, mesh, tp, data_sizes, vocab,
                                    padded_vocab)
    ep = mesh.size("ep")
    if ep > 1:
        experts = [p.path for p in plan.params.values() if p.ep_dim is not None]
        if not experts:
            raise ConfigError(f"mesh {mesh.describe()}: ep={ep} splits the experts of MoE layers, and no parameter "
                              f"is split over ep (a model without experts, or rules without 'expert': 'ep'); "
                              f"drop ep from --mesh (its ranks are data ranks already) or map 'expert' to 'ep'")
        plan.notes.append(f"ep={ep}: {len(experts)} expert tensors split over ep (each ep rank 1/{ep} of the experts), "
                          f"tokens sent to their experts' ranks and back by all-to-all; the batch is split over "
                          f"all {mesh.data_size} data ranks")
    if mesh.size("cp") > 1:
        plan.notes.append(f"cp={mesh.size('cp')}: each sequence is split into head-tail chunks over cp; parameters "
                          f"are replicated over it and their gradients summed over it in the backward")
    if pipeline is not None:
        sharded = [p.path for p in plan.params.values() if p.data_axes["grad"]]
        if sharded:
            raise ConfigError(f"pp={mesh.size('pp')} with gradients sharded over the data axes ({sharded[0]}, zero "
                              f"{zero} / fsdp rules): the pipeline schedule accumulates gradients over microbatches "
                              f"inside the stage, so they cannot be reduce-scattered per microbatch. Use --zero 1 "
                              f"(optimizer state sharded, as Megatron-LM's distributed optimizer does with pp) or 0")
        tied = [p for p in plan.params if len(plan.pp_owners(p)) > 1]
        if tied:
            plan.notes.append(f"{', '.join(tied)} held by pp ranks {plan.pp_owners(tied[0])} (first and last stage); "
                              f"their gradients are summed over pp, so the copies stay identical")
    return plan


def _layout(path: str, spec: ParamSpec, rules: dict, zero: int, mesh: MeshSpec, tp: int,
            data_sizes: dict[str, int], vocab: int, padded_vocab: int) -> ParamLayout:
    shape = tuple(padded_vocab if a == "vocab" and n == vocab else n for a, n in zip(spec.axes, spec.shape))
    tp_dim = zero_dim = ep_dim = None
    rule_data_axes: tuple[str, ...] = ()
    # ep folded over fsdp: the fsdp ranks a dense parameter is sharded over are fsdp x ep
    # (an expert's, fsdp alone: ep splits its experts instead)
    ep_in_fsdp = mesh.ep_over == "fsdp" and mesh.size("ep") > 1 and "expert" not in spec.axes
    for dim, name in enumerate(spec.axes):
        written = mesh_axes_of(rules.get(name))
        axes = [a for a in written if mesh.size(a) > 1]
        for axis in axes + (["ep"] if ep_in_fsdp and "fsdp" in written else []):
            if axis == "ep" and ep_in_fsdp:
                zero_dim = dim
                rule_data_axes += ("ep",)
            elif axis == "ep" or name == "expert":
                if (axis, name) != ("ep", "expert"):
                    raise ConfigError(f"parameter {path}: rule {name!r} -> {axis!r}; the ep axis splits the experts "
                                      f"of a MoE layer (logical axis 'expert') and nothing else: map 'expert' to "
                                      f"'ep' and {name!r} elsewhere")
                ep_dim = dim
            elif axis == "tp":
                if tp_dim is not None:
                    raise ConfigError(f"parameter {path} {spec.shape} {spec.axes}: the tp axis would split both dim "
                                      f"{tp_dim} ({spec.axes[tp_dim]}) and dim {dim} ({name}); map one of them to None")
                tp_dim = dim
            elif axis in DATA_AXES:
                if zero_dim is not None and zero_dim != dim:
                    raise ConfigError(f"parameter {path} {spec.axes}: data axes would split both dim {zero_dim} and "
                                      f"dim {dim}; split one dim per parameter over dp/fsdp")
                zero_dim = dim
                rule_data_axes += (axis,)
            else:
                raise ConfigError(f"parameter {path}: rule {name!r} -> {axis!r}; parameters can be split only over "
                                  f"tp, dp, fsdp and (experts) ep")
    if tp_dim is not None and tp_dim == zero_dim:
        raise ConfigError(f"parameter {path} {spec.axes}: dim {tp_dim} ({spec.axes[tp_dim]}) is split over both tp and "
                          f"data axes; split different dims (the presets split embed over data axes and "
                          f"heads/mlp/vocab over tp)")
    # ZeRO shards over every rank holding a replica: dp, and the ep ranks for what they do not split
    zero_axes = tuple(a for a in ("dp", "ep") if mesh.size(a) > 1 and not (a == "ep" and ep_dim is not None))
    if zero_dim is None and zero > 0 and "embed" in spec.axes and zero_axes:
        zero_dim = spec.axes.index("embed")
        if zero_dim == tp_dim:
            zero_dim = None
    zero_split = zero_axes if zero_dim is not None else ()
    ordered = lambda axes: tuple(a for a in DATA_AXES if a in set(axes))  # noqa: E731
    data_axes = {
        "param": ordered(rule_data_axes + (zero_split if zero >= 3 else ())),
        "grad": ordered(rule_data_axes + (zero_split if zero >= 2 else ())),
        "opt": ordered(rule_data_axes + (zero_split if zero >= 1 else ())),
    }
    if data_axes["param"] and data_axes["opt"] != data_axes["param"]:
        raise ConfigError(f"zero {zero} shards optimizer state over dp, but the rules already shard {path} "
                          f"over {'x'.join(data_axes['param'])}: use zero 3 (parameters sharded over dp too) or "
                          f"zero 0 (HSDP: replicated over dp)")
    if tp_dim is not None and shape[tp_dim] % tp:
        n = shape[tp_dim]
        raise ConfigError(f"parameter {path}: dim {tp_dim} ({spec.axes[tp_dim]}) has size {n}, which tp={tp} does not "
                          f"divide; choose a tp size that divides {n} or change the model (e.g. "
                          f"{spec.axes[tp_dim]} = {(n // tp + 1) * tp})")
    if zero_dim is not None:
        split = math.prod(data_sizes[a] for a in data_axes["opt"])
        if shape[zero_dim] % split:
            raise ConfigError(f"parameter {path}: dim {zero_dim} ({spec.axes[zero_dim]}) has size {shape[zero_dim]}, "
                              f"which the data axes {'x'.join(data_axes['opt'])} (size {split}) do not divide; "
                              f"choose data-parallel sizes that divide {shape[zero_dim]}"
                              + (", or keep this one with --use-distributed-optimizer (ZeRO-1/2 over flat buffers, "
                                 "which any data-parallel size shards)" if zero < 3 else ""))
    if ep_dim is not None and shape[ep_dim] % mesh.size("ep"):
        raise ConfigError(f"parameter {path}: {shape[ep_dim]} experts, which ep={mesh.size('ep')} does not divide; "
                          f"choose an ep size that divides the number of experts")
    return ParamLayout(path, shape, spec.axes, tp_dim, zero_dim, data_axes, tp, data_sizes, ep_dim)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def explain(plan: ShardingPlan) -> str:
    mesh = plan.mesh
    s = plan.strategy
    lines = [f"mesh: {mesh.describe()}; physical order {' > '.join(PHYSICAL_ORDER)} (tp varies fastest)",
             f"strategy: {s.name}, zero {s.zero}" + (", sequence parallel" if plan.sequence_parallel else ""),
             "rules: " + ", ".join(f"{k} -> {v}" for k, v in s.rules.items())]
    lines += [f"note: {n}" for n in plan.notes]
    axes_hdr = ",".join(mesh.names) or "-"
    rows = [("parameter", "global shape", "logical axes", f"placements ({axes_hdr})", "local shape", "bytes/rank")]
    for p in plan.params.values():
        pl = " ".join(p.placement_names("param", mesh)) or "-"
        opt = " ".join(p.placement_names("opt", mesh))
        if opt != pl and opt:
            pl += f" | opt {opt}"
        if plan.pipeline is not None:
            pl += " @ pp " + ",".join(map(str, plan.pp_owners(p.path)))
        axes = "(" + ", ".join(map(str, p.axes)) + ")"  # None: a dimension no rule splits
        rows.append((p.path, str(list(p.shape)), axes, pl, str(list(p.local_shape())),
                     format_bytes(p.local_numel() * plan.param_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 5 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if plan.pipeline is not None:
        lines += plan.pipeline.describe()
    for r in range(mesh.size("pp")):
        b = plan.bytes_per_rank(r)
        who = f"pp rank {r}" if plan.pipeline is not None else "per rank"
        lines.append(f"{who}: parameters {format_bytes(b['param'])}, gradients {format_bytes(b['grad'])}, "
                     f"AdamW state {format_bytes(b['opt'])}, total {format_bytes(sum(b.values()))} (fp32)")
    resid = plan.activation_tp_dims(("batch", "seq", "embed"))
    lines.append("activations: batch split over the data axes (each data rank reads its own micro batches); "
                 "residual stream [batch, seq, embed] " + ("split along seq over tp (sequence parallel)" if resid == 1
                                                          else "replicated over tp") +
                 "; inside blocks heads/mlp/vocab split over tp" * (plan.tp > 1) +
                 "; the sequence split over cp everywhere, attention's keys and values gathered" *
                 (plan.mesh.size("cp") > 1))
    return "\n".join(lines)
