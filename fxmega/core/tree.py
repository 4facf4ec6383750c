"""Pytree helpers for parameter trees: nested dicts (and lists) with tensors at the leaves.

Paths are dot-joined keys (``blocks.3.attn.wq``); they name parameters in specs, plans,
checkpoints and seeds, so the order of leaves is the insertion order of the dicts and
never depends on the device or mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Tree = Any


def items(tree: Tree, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` pairs in a deterministic order."""
    if isinstance(tree, dict):
        for key, sub in tree.items():
            yield from items(sub, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, sub in enumerate(tree):
            yield from items(sub, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def paths(tree: Tree) -> list[str]:
    return [p for p, _ in items(tree)]


def leaves(tree: Tree) -> list[Any]:
    return [leaf for _, leaf in items(tree)]


def map_leaves(fn: Callable[..., Any], tree: Tree, *others: Tree) -> Tree:
    """Apply ``fn`` leaf by leaf over trees of the same structure."""
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(fn, v, *(o[i] for o in others)) for i, v in enumerate(tree)]
    return fn(tree, *others)


def map_with_path(fn: Callable[[str, Any], Any], tree: Tree, prefix: str = "") -> Tree:
    """Apply ``fn(path, leaf)`` to every leaf."""
    if isinstance(tree, dict):
        return {k: map_with_path(fn, v, f"{prefix}{k}.") for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_with_path(fn, v, f"{prefix}{i}.") for i, v in enumerate(tree)]
    return fn(prefix[:-1], tree)


def unflatten_like(tree: Tree, flat: list[Any]) -> Tree:
    """Rebuild ``tree``'s structure with the leaves taken in order from ``flat``."""
    it = iter(flat)
    out = map_leaves(lambda _: next(it), tree)
    if next(it, None) is not None:
        raise ValueError("more leaves than the tree has")
    return out


def get(tree: Tree, path: str) -> Any:
    """The leaf (or subtree) at a dot-joined path."""
    node = tree
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node
