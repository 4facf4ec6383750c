"""Device meshes: ``--mesh 8x4x2`` or ``--mesh dp=8,tp=4,pp=2``.

A ``MeshSpec`` is pure data (axis names and sizes), so plans can be made and printed for
any mesh on one machine. ``build_device_mesh`` turns it into a torch ``DeviceMesh`` once a
process group exists.

Axes:
  dp    data parallel, parameters replicated (ZeRO 1/2/3 can shard state over it)
  fsdp  data parallel, parameters sharded by the rules (e.g. the ``embed`` dim)
  tp    tensor parallel (Megatron layouts, optional sequence parallelism)
  pp    pipeline parallel (stages cut from the layer stack)
  cp    context parallel (each sequence split into head-tail chunks; parameters replicated)
  ep    expert parallelism: the experts of a MoE layer split over ep ranks, tokens sent to
        their experts' ranks and back with all-to-all

``ep`` is folded over the data ranks (Megatron-Core's "parallel folding", torchtitan's ep):
``--mesh dp=4,tp=2,ep=2`` is 8 ranks, 4 data ranks of which each pair of neighbours holds
half of every MoE layer's experts. Dense parameters see 4 data ranks; expert parameters are
replicated over the 2 "expert data" ranks and split over ep. In the physical mesh the dp
axis written becomes ``dp`` (the expert-data part, size dp / ep) times ``ep``, and both
split the batch: ``MeshSpec`` holds those physical sizes.

Physical rank order follows Megatron-LM whatever order is written: tp varies fastest, then
cp, ep, fsdp, dp, and pp slowest, so tensor-parallel groups sit on neighbouring devices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fxmega.core.errors import ConfigError

PHYSICAL_ORDER = ("pp", "dp", "fsdp", "ep", "cp", "tp")  # slowest to fastest
DATA_AXES = ("dp", "fsdp", "ep")  # the axes that split the batch (ep folded over the written dp or fsdp)
DEFAULT_ORDER = ("dp", "tp", "pp", "cp")  # --mesh 8x4x2 is dp x tp x pp; a fourth size is cp


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes, held in physical order (slowest first); absent axes have size 1. ``ep_over``
    says which written data axis ep was folded over: dp (Megatron's "expert-data" ranks), or
    fsdp (torchtitan's: the dense parameters sharded over fsdp x ep, the experts over fsdp)."""

    sizes: tuple[tuple[str, int], ...]
    ep_over: str = "dp"

    @staticmethod
    def of(**sizes: int) -> MeshSpec:
        for axis in sizes:
            if axis not in PHYSICAL_ORDER:
                raise ConfigError(f"unknown mesh axis {axis!r}: use {', '.join(PHYSICAL_ORDER)}")
        return MeshSpec(tuple((a, int(sizes[a])) for a in PHYSICAL_ORDER if a in sizes))

    @staticmethod
    def parse(text: str, order: tuple[str, ...] = DEFAULT_ORDER) -> MeshSpec:
        return parse_mesh(text, order)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.sizes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: how many ways the global batch is split."""
        return math.prod(self.size(a) for a in DATA_AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis (row-major over the physical order)."""
        out, rest = {}, rank
        for axis, n in reversed(self.sizes):
            out[axis] = rest % n
            rest //= n
        return {a: out.get(a, 0) for a in PHYSICAL_ORDER}

    def data_rank(self, rank: int) -> int:
        """Index of ``rank``'s slice of the global batch: dp-major over (dp, fsdp, ep)."""
        c, index = self.coords(rank), 0
        for axis in DATA_AXES:
            index = index * self.size(axis) + c[axis]
        return index

    def describe(self) -> str:
        """The mesh as written (dp or fsdp counts every rank ep folds over), with ep's folding
        spelled out."""
        ep, over = self.size("ep"), self.ep_over
        parts = []
        for a, n in self.sizes:
            if a == over and ep > 1:
                parts.append(f"{over}={n * ep} [ep={ep} x expert-{'data' if over == 'dp' else 'fsdp'} {n}]")
            elif a == "ep":
                if over not in self.names:
                    parts.append(f"{over}={n} [ep={n}]")
            else:
                parts.append(f"{a}={n}")
        axes = " x ".join(parts) or "single device"
        return f"{axes} ({self.world_size} rank{'s' if self.world_size != 1 else ''})"

    def rank_table(self, limit: int = 16) -> str:
        rows = [f"  rank {r:>4}: " + ", ".join(f"{a}={c}" for a, c in self.coords(r).items() if a in self.names)
                for r in range(min(self.world_size, limit))]
        if self.world_size > limit:
            rows.append(f"  ... {self.world_size - limit} more")
        return "\n".join(rows)


def parse_mesh(text: str, order: tuple[str, ...] = DEFAULT_ORDER) -> MeshSpec:
    """``"2x2"`` gives sizes to ``order`` in turn; ``"dp=2,tp=2"`` names the axes."""
    text = text.strip().replace(" ", "")
    if not text:
        raise ConfigError("empty --mesh: write sizes like 2x2 (dp x tp) or names like dp=2,tp=2")
    sizes: dict[str, int] = {}
    if "=" in text:
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name not in PHYSICAL_ORDER:
                raise ConfigError(f"--mesh {text}: unknown axis {name!r}; axes are {', '.join(PHYSICAL_ORDER)}")
            if name in sizes:
                raise ConfigError(f"--mesh {text}: axis {name!r} is given twice")
            sizes[name] = _size(value, name, text)
    else:
        parts = re.split(r"[x*]", text)
        if len(parts) > len(order):
            raise ConfigError(
                f"--mesh {text} gives {len(parts)} sizes but the axis order {' x '.join(order)} names only "
                f"{len(order)}: name the axes instead, e.g. --mesh dp=2,fsdp=2,tp=2,pp=2"
            )
        for name, value in zip(order, parts):
            sizes[name] = _size(value, name, text)
    folded, over = fold_ep(sizes, text)
    return MeshSpec(MeshSpec.of(**folded).sizes, over)


def fold_ep(sizes: dict[str, int], text: str) -> tuple[dict[str, int], str]:
    """The written sizes with ep folded over a data axis, and which: over fsdp where the mesh
    has one (``fsdp=4,ep=2`` -> physical fsdp=2 x ep=2: dense parameters sharded 4 ways,
    experts 2 ways, torchtitan's layout), else over dp (``dp=4,ep=2`` -> dp=2 x ep=2:
    Megatron's expert-data parallelism)."""
    ep = sizes.pop("ep", 1)
    over = "fsdp" if sizes.get("fsdp", 1) > 1 else "dp"
    if ep == 1:
        return sizes, "dp"
    n = sizes.get(over, 1)
    if n % ep:
        raise ConfigError(f"--mesh {text}: ep={ep} does not divide {over}={n}; ep is folded over the {over} ranks "
                          f"(each expert group is ep of them, adding no ranks of its own): choose ep dividing "
                          f"{over}, e.g. --mesh {over}={ep * max(1, n // ep)},ep={ep}")
    return {**sizes, over: n // ep, "ep": ep}, over


def _size(value: str, name: str, text: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--mesh {text}: size {value!r} of axis {name} is not a whole number") from None
    if n <= 0:
        raise ConfigError(f"--mesh {text}: axis {name} has size {n}; sizes must be at least 1")
    return n


def check_world_size(spec: MeshSpec, world_size: int, argv_hint: str = "run.py ...") -> None:
    """The mesh must use every process exactly once."""
    if spec.world_size != world_size:
        raise ConfigError(
            f"mesh {spec.describe()} needs {spec.world_size} processes but the world size is {world_size}: "
            f"launch with `torchrun --nproc-per-node={spec.world_size} {argv_hint}` (or run `python {argv_hint}` "
            f"without a launcher and fxmega starts {spec.world_size} local processes), or choose a mesh whose sizes "
            f"multiply to {world_size}"
        )


def build_device_mesh(spec: MeshSpec, device_type: str):  # -> torch.distributed.device_mesh.DeviceMesh
    """The torch DeviceMesh for ``spec`` over the current process group (axes in physical
    order, so the ranks of a tp group are consecutive)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = spec.names or ("dp",)
    shape = spec.shape or (1,)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
