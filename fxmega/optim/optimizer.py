"""The optimizer interface.

An optimizer declares its state and updates in place:

- ``state``: one ``StateSpec`` per tensor it keeps per parameter, each shaped like the
  parameter and laid out as the parameter's optimizer shard (``ParamLayout.local_shape
  ("opt")``: ZeRO and the distributed optimizer shard it, the memory tables count its bytes,
  checkpoints save it under ``opt.<name>.<parameter>``), plus a step count;
- ``update(params, grads, state, lr, roles, apply)``: one step over lists of this rank's
  tensors (``roles``: what each one is, ``ParamRole``), writing the new values into
  ``params`` and ``state`` (donated, as
  ``jax.jit(..., donate_argnums)`` does), with ``apply`` (0-dim 0./1.) making it a no-op
  without a branch (the skip of a non-finite step).

Gradient reduction, clipping and loss scaling happen before it (``fxmega.training.update``),
the same for every optimizer. ``optimizer_for(cfg.optim)`` picks one by ``optim.optimizer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from fxmega.config import OptimConfig
from fxmega.core.errors import ConfigError
from fxmega.optim.matrices import MatrixView


@dataclass(frozen=True)
class StateSpec:
    """One tensor an optimizer keeps per parameter, shaped like it: its name (the checkpoint
    key ``opt.<name>.<parameter>``) and dtype (what the memory tables count)."""

    name: str
    dtype: torch.dtype = torch.float32


class MatrixPieces(Protocol):
    """How a rank's part of a hidden matrix (its optimizer view, sliced by tp or ZeRO) is
    made whole and cut again: ``gather`` (a collective, inside the step's graph) gives every
    rank of the slicing groups the whole tensor, ``narrow`` this rank's part of one."""

    def gather(self, part: torch.Tensor) -> torch.Tensor: ...

    def narrow(self, whole: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ParamRole:
    """What an optimizer may treat differently in a parameter: whether it takes decoupled
    weight decay, how it is a stack of hidden matrices (None: a table, norm or bias), and on
    a mesh that slices the matrix, how its pieces are put together (None: the rank holds
    it whole). Computed once per parameter from its spec (``fxmega.training.optim.param_roles``)
    and the rank's layout (``fxmega.parallel.matrix_pieces``)."""

    decay: bool
    matrix: MatrixView | None = None
    pieces: MatrixPieces | None = None


class Optimizer(Protocol):
    name: str
    state: tuple[StateSpec, ...]
    # True: the update of a hidden matrix reads the whole matrix (Muon's orthogonalisation),
    # not element by element; a layout that gives a rank a slice of one is refused
    whole_matrices: bool

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: torch.Tensor,
               roles: list[ParamRole], apply: torch.Tensor) -> None: ...


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state per parameter element."""
    return sum(torch.empty((), dtype=s.dtype).element_size() for s in optimizer.state)


def init_state(optimizer: Optimizer, zeros: Callable[[torch.dtype], list[torch.Tensor]],
               device: torch.device | str) -> dict:
    """A fresh state: the step count, and for each ``StateSpec`` the zeros ``zeros(dtype)``
    gives (one per local parameter, in its optimizer layout)."""
    return {"step": torch.zeros((), dtype=torch.float32, device=device),
            **{s.name: zeros(s.dtype) for s in optimizer.state}}


_OPTIMIZERS: dict[str, Callable[[OptimConfig], Optimizer]] = {}


def register(name: str, build: Callable[[OptimConfig], Optimizer]) -> None:
    """Make ``optim.optimizer=name`` build ``build(cfg.optim)``."""
    _OPTIMIZERS[name] = build


def unregister(name: str) -> None:
    """Forget optimizer ``name`` (for tests that register one of their own)."""
    _OPTIMIZERS.pop(name, None)


def names() -> list[str]:
    return sorted(_OPTIMIZERS)


def optimizer_for(cfg: OptimConfig) -> Optimizer:
    """The optimizer ``cfg.optimizer`` names, with ``cfg``'s hyper-parameters."""
    build = _OPTIMIZERS.get(cfg.optimizer)
    if build is None:
        raise ConfigError(f"optim.optimizer={cfg.optimizer!r}: use one of {', '.join(names())}")
    return build(cfg)
