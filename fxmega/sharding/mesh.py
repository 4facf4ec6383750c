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
  ep    reserved for expert parallelism (not implemented)

Physical rank order follows Megatron-LM whatever order is written: tp varies fastest, then
cp, ep, fsdp, dp, and pp slowest, so tensor-parallel groups sit on neighbouring devices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fxmega.core.errors import ConfigError

PHYSICAL_ORDER = ("pp", "dp", "fsdp", "ep", "cp", "tp")  # slowest to fastest
DATA_AXES = ("dp", "fsdp")
RESERVED_AXES = ("ep",)
DEFAULT_ORDER = ("dp", "tp", "pp", "cp")  # --mesh 8x4x2 is dp x tp x pp; a fourth size is cp


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes, held in physical order (slowest first); absent axes have size 1."""

    sizes: tuple[tuple[str, int], ...]

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
        return self.size("dp") * self.size("fsdp")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis (row-major over the physical order)."""
        out, rest = {}, rank
        for axis, n in reversed(self.sizes):
            out[axis] = rest % n
            rest //= n
        return {a: out.get(a, 0) for a in PHYSICAL_ORDER}

    def data_rank(self, rank: int) -> int:
        """Index of ``rank``'s slice of the global batch: dp-major over (dp, fsdp)."""
        c = self.coords(rank)
        return c["dp"] * self.size("fsdp") + c["fsdp"]

    def describe(self) -> str:
        axes = " x ".join(f"{a}={n}" for a, n in self.sizes) or "single device"
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
    for axis in RESERVED_AXES:
        if sizes.get(axis, 1) > 1:
            raise ConfigError(f"--mesh {text}: axis {axis} is reserved for expert parallelism, "
                              f"which fxmega does not implement yet")
    return MeshSpec.of(**sizes)


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


def check_model_mesh(cfg: Any, spec: MeshSpec, model: Any) -> None:
    """Refuse, before anything is built, a mesh the model family says it cannot run on: a
    family may define ``check_mesh(cfg, spec)`` (e.g. experts not yet split over tp)."""
    check = getattr(model, "check_mesh", None)
    if check is not None:
        check(cfg, spec)


def build_device_mesh(spec: MeshSpec, device_type: str):  # -> torch.distributed.device_mesh.DeviceMesh
    """The torch DeviceMesh for ``spec`` over the current process group (axes in physical
    order, so the ranks of a tp group are consecutive)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = spec.names or ("dp",)
    shape = spec.shape or (1,)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
