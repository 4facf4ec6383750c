"""Model families by name. A family is one module (or any object with the same attributes):
its ``Config``, ``param_specs(cfg)``, its pieces — ``embed``, ``block``, ``head``, the units
that pipelining, ZeRO-3 gathering, recompute and the estimates work on — the parameter
groups each piece reads, and its training objective. Families register here, and
everything else (configs, checkpoints, the runtime, the commands) finds a family through
the registry, never through a list of known names.

    from fxmega.models import registry
    registry.register("mymodel", mymodel)   # a module defining the attributes below
"""

from __future__ import annotations

from typing import Any, Protocol

from fxmega.core.errors import ConfigError
from fxmega.ops.objectives import Objective


class ModelConfig(Protocol):
    """What every family's ``Config`` (a frozen dataclass) has."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    init_std: float

    def validate(self, prefix: str = ...) -> None: ...


class ModelFamily(Protocol):
    """The attributes of a family module. ``embed(params, tokens, cfg, *EMBED_INPUTS)`` starts
    the residual stream ``[batch, seq, d_model]``, ``block(params, x, cfg, valid=None)`` is
    one layer on it, ``head(params, x, cfg)`` turns it into the objective's outputs;
    ``EMBED_PARAMS`` and ``HEAD_PARAMS`` are the top-level parameter groups the first and
    the last read (a tied embedding is in both), ``params["blocks"]`` the list of layers.

    Optional: ``HEAD_INPUTS``, what ``head`` reads from the batch after ``x`` and ``cfg``
    (default none; a classifier's reads the attention mask); ``OUTPUT_AXES``, the logical
    axes of the head's outputs (default ``("batch", None, "vocab")``: logits over the
    vocabulary); ``POOL_PARAMS`` and ``pool(params, x, valid, cfg) -> [batch, embed]``, what
    ``fxmega.models.classifier`` puts a classification head on; ``attend_inputs(cfg, seq_len,
    device, valid, positions)``, what every block's attention reads that no layer changes
    (rotary tables, masks), built once per step and given to blocks as
    ``block(params, x, cfg, valid, attend)``; ``CONTEXT_PARALLEL = True`` when those honour
    each token's ``positions`` (and the embedding reads them), so that context parallelism may
    hand it out-of-order chunks; ``BLOCK_SHARED_PARAMS``, top-level groups every block reads
    besides its own (T5's relative position tables), given to each block in its tree."""

    Config: type
    EMBED_PARAMS: tuple[str, ...]
    HEAD_PARAMS: tuple[str, ...]
    EMBED_INPUTS: tuple[str, ...]

    def param_specs(self, cfg: Any) -> dict: ...

    def embed(self, params: dict, tokens: Any, cfg: Any, *inputs: Any) -> Any: ...

    def block(self, params: dict, x: Any, cfg: Any, valid: Any = None) -> Any: ...

    def head(self, params: dict, x: Any, cfg: Any) -> Any: ...

    def objective(self, cfg: Any) -> Objective: ...


REQUIRED = ("Config", "param_specs", "embed", "block", "head", "EMBED_PARAMS", "HEAD_PARAMS", "EMBED_INPUTS",
            "objective")
_FAMILIES: dict[str, ModelFamily] = {}


def register(name: str, family: Any) -> ModelFamily:
    """Make ``family`` known as ``name``; returns it. Refuses a family that lacks one of
    ``REQUIRED``, a name already taken by another family, and a ``Config`` class another
    family already uses (a config must name exactly one family)."""
    missing = [a for a in REQUIRED if not hasattr(family, a)]
    if missing:
        raise ConfigError(f"model family {name!r} lacks {', '.join(missing)}: a family defines {', '.join(REQUIRED)}")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"model family name {name!r}: use letters, digits, '-' and '_'")
    taken = _FAMILIES.get(name)
    if taken is not None and taken is not family:
        raise ConfigError(f"model family {name!r} is already registered (by {getattr(taken, '__name__', taken)})")
    for other, fam in _FAMILIES.items():
        if fam.Config is family.Config and other != name:
            raise ConfigError(f"{family.Config.__name__} is already the Config of model family {other!r}")
    _FAMILIES[name] = family
    return family


def unregister(name: str) -> None:
    """Forget family ``name`` (for tests that register one of their own)."""
    _FAMILIES.pop(name, None)


def names() -> list[str]:
    return sorted(_FAMILIES)


def get(name: str) -> ModelFamily:
    """The family registered as ``name``."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ConfigError(f"model family {name!r} is not registered; known: {', '.join(names())}") from None


def family_of(cfg: object) -> ModelFamily:
    """The family whose ``Config`` class ``cfg`` is."""
    for family in _FAMILIES.values():
        if type(cfg) is family.Config:
            return family
    raise ConfigError(f"model config {type(cfg).__name__} is not the Config of a registered model family "
                      f"({', '.join(names())}); register its family with fxmega.models.registry.register")


def name_of(cfg: object) -> str:
    """The registered name of ``cfg``'s family."""
    family = family_of(cfg)
    return next(name for name, fam in _FAMILIES.items() if fam is family)
