"""Model families by name. A family is one ``ModelFamily`` value
(``fxmega.models.family``): its ``Config``, ``param_specs(cfg)``, its pieces — ``embed``,
``block``, ``head``, the units that pipelining, ZeRO-3 gathering, recompute and the
estimates work on — the parameter groups each piece reads, its training objective, and its
optional capabilities with their defaults. Families register here, and everything else
(configs, checkpoints, the runtime, the commands) finds a family through the registry, never
through a list of known names.

    from fxmega.models import registry
    registry.register(mymodel.FAMILY)   # FAMILY = ModelFamily(name="mymodel", ...)
"""

from __future__ import annotations

from fxmega.core.errors import ConfigError
from fxmega.models.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known as ``family.name``; returns it. Refuses what is not a
    ``ModelFamily``, a name already taken by another family, and a ``Config`` class another
    family already uses (a config must name exactly one family)."""
    if not isinstance(family, ModelFamily):
        raise ConfigError(f"register a ModelFamily (fxmega.models.family), not {type(family).__name__}: end the "
                          f"family's module with FAMILY = ModelFamily(name=..., Config=Config, param_specs=..., ...)")
    name = family.name
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"model family name {name!r}: use letters, digits, '-' and '_'")
    taken = _FAMILIES.get(name)
    if taken is not None and taken is not family:
        raise ConfigError(f"model family {name!r} is already registered (its Config is {taken.Config.__name__})")
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
    return family_of(cfg).name
