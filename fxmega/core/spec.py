"""What a parameter is before it exists: its shape, the logical name of every dim, and how
to initialise it. Models return trees of ``ParamSpec``; the planner and the initialiser
read them. Nothing here allocates memory."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Init:
    """An initialiser: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``."""

    kind: str
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "zeros", "ones"):
            raise ValueError(f"unknown init kind {self.kind!r}: use normal, zeros or ones")


def normal(std: float) -> Init:
    return Init("normal", std)


ZEROS = Init("zeros")
ONES = Init("ones")


@dataclass(frozen=True)
class ParamSpec:
    """Shape, logical axis names (one per dim) and initialiser of one parameter.

    Axis names are the vocabulary the sharding rules speak: ``("embed", "mlp")`` says the
    first dim is the model width and the second the MLP hidden width; the rules decide
    which mesh axis, if any, each name is split over.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: Init
    # 0: trained by AdamW. Else not trained on a loss: its "gradient" is a count the forward
    # reports (tokens per expert) and the update moves it by sign_rate x sign(mean - count)
    # (DeepSeek-V3's auxiliary-loss-free expert bias)
    sign_rate: float = 0.0

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(
                f"ParamSpec shape {self.shape} has {len(self.shape)} dims but axes "
                f"{self.axes} name {len(self.axes)}: name every dim once"
            )
        if any(int(n) <= 0 for n in self.shape):
            raise ValueError(f"ParamSpec shape {self.shape} has a dim that is not positive")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
