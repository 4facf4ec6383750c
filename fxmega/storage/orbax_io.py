"""orbax-checkpoint interop (the ``orbax`` extra, which brings jax): a consolidated model as
an orbax pytree of numpy arrays, so it moves between fxmega and the JAX world.

    DIR/fxmega_model.json   model family and config
    DIR/params/             orbax StandardCheckpointer directory: the parameter tree

One process writes (call from rank 0 with full tensors): two processes sharing one orbax
step directory lost an item in 3 of 3 trials on these machines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.core.json_files import read_object
from fxmega.models import registry
from fxmega.models.family import ModelConfig


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ConfigError("orbax interop needs orbax-checkpoint: pip install -e '.[orbax]' (it brings jax)") from None
    return ocp


def to_orbax(family: str, cfg: ModelConfig, params: dict, path: str | Path) -> Path:
    """Write ``params`` (full tensors) and the model config under ``path``."""
    ocp = _orbax()
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    arrays = tree.map_leaves(lambda t: t.detach().cpu().float().numpy(), params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", arrays, force=True)
    checkpointer.wait_until_finished()
    (path / "fxmega_model.json").write_text(json.dumps({"family": family, "config": dataclasses.asdict(cfg)}))
    return path


def from_orbax(path: str | Path) -> tuple[str, Any, dict]:
    """(family, Config, parameter tree of torch tensors) from a directory ``to_orbax`` wrote."""
    ocp = _orbax()
    path = Path(path).resolve()
    fix = "export it with run.py convert --to-orbax"
    described = read_object(path / "fxmega_model.json", CheckpointError, fix,
                            required={"family": str, "config": dict})
    family = described["family"]
    if family not in registry.names():
        raise CheckpointError(f"{path / 'fxmega_model.json'} names family {family!r}; fxmega has "
                              f"{registry.names()}; {fix}")
    try:
        cfg = registry.get(family).Config(**described["config"])
    except TypeError as e:  # a field this version's Config does not have, or lacks
        raise CheckpointError(f"{path / 'fxmega_model.json'}: its config does not fit {family}.Config ({e}); "
                              f"{fix}") from None
    arrays = ocp.StandardCheckpointer().restore(path / "params")
    specs = registry.get(family).param_specs(cfg)
    flat = dict(tree.items(arrays))
    missing = [p for p in tree.paths(specs) if p not in flat]
    if missing:
        raise CheckpointError(f"{path / 'params'} lacks {missing[0]} ({len(missing)} arrays missing) for a {family} "
                              f"model with {cfg.n_layers} layers")
    params = tree.map_with_path(lambda p, _: torch.from_numpy(np.asarray(flat[p]).copy()), specs)
    return family, cfg, params
