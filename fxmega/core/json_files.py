"""Reading JSON files that fxmega did not just write (checkpoint manifests and meta, model
configs, vocabularies, shard indexes): a file that parses but has the wrong shape — ``0``
where an object belongs, a field of the wrong type — is one of fxmega's own errors naming
the file, the field and the fix, never a ``TypeError`` or ``KeyError`` from deep inside
the code that uses it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fxmega.core.errors import FxmegaError

# what a field may hold, as Python's types; ``int`` excludes ``bool`` (JSON true is no count)
FieldType = type | tuple[type, ...]


_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
          float: "a number", type(None): "null"}


def _kind(value: Any) -> str:
    return _NAMES.get(type(value), type(value).__name__)


def _wanted(types: FieldType) -> str:
    return " or ".join(_NAMES.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))


def is_a(value: Any, types: FieldType) -> bool:
    """``isinstance`` as JSON means it: a boolean is not an integer, an integer is a number."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def read_json(path: Path, error: type[FxmegaError], fix: str) -> Any:
    """The parsed contents of ``path``; a missing, unreadable or invalid file is ``error``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path} cannot be read as UTF-8 text ({type(e).__name__}: {e}); {fix}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from None


def check_fields(value: Any, where: str, error: type[FxmegaError], fix: str,
                 required: Mapping[str, FieldType] | None = None,
                 optional: Mapping[str, FieldType] | None = None) -> dict[str, Any]:
    """``value`` as an object whose ``required`` fields are present and whose ``required``
    and ``optional`` fields have the given types (other fields pass unchecked)."""
    if not isinstance(value, dict):
        raise error(f"{where} holds {_kind(value)} ({_short(value)}) where an object belongs; {fix}")
    for name in required or {}:
        if name not in value:
            raise error(f"{where} has no field {name!r} (it has {sorted(value)[:8]}); {fix}")
    for name, types in {**(optional or {}), **(required or {})}.items():
        if name in value and not is_a(value[name], types):
            raise error(f"{where}: field {name!r} is {_kind(value[name])} ({_short(value[name])}), it must be "
                        f"{_wanted(types)}; {fix}")
    return value


def read_object(path: Path, error: type[FxmegaError], fix: str, required: Mapping[str, FieldType] | None = None,
                optional: Mapping[str, FieldType] | None = None) -> dict[str, Any]:
    """``read_json`` of a file that must hold one object, its fields checked as ``check_fields`` does."""
    return check_fields(read_json(path, error, fix), str(path), error, fix, required, optional)


def _short(value: Any) -> str:
    text = json.dumps(value) if is_a(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
