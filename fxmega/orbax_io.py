"""orbax-checkpoint interop (the ``orbax`` extra, which brings jax): a consolidated model as
an orbax pytree of numpy arrays, so it moves between fxmega and the JAX world.

    DIR/fxmega_model.json   model family and config
    DIR/params/             orbax StandardCheckpointer directory: the parameter tree

One process writes (call from rank 0 with full tensors): ../shared/DESIGN.md records that
two processes sharing one orbax step directory lost data on these machines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxmega import tree
from fxmega.errors import CheckpointError, ConfigError
from fxmega.models import FAMILIES


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ConfigError("orbax interop needs orbax-checkpoint: pip install -e '.[orbax]' (it brings jax)") from None
    return ocp


def to_orbax(family: str, cfg: Any, params: dict, path: str | Path) -> Path:
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
    try:
        described = json.loads((path / "fxmega_model.json").read_text())
        family = described["family"]
        cfg = FAMILIES[family].Config(**described["config"])
    except (FileNotFoundError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} has no usable fxmega_model.json ({type(e).__name__}: {e}): export it with "
                              f"run.py convert --to-orbax") from None
    arrays = ocp.StandardCheckpointer().restore(path / "params")
    specs = FAMILIES[family].param_specs(cfg)
    flat = dict(tree.items(arrays))
    missing = [p for p in tree.paths(specs) if p not in flat]
    if missing:
        raise CheckpointError(f"{path / 'params'} lacks {missing[0]} ({len(missing)} arrays missing) for a {family} "
                              f"model with {cfg.n_layers} layers")
    params = tree.map_with_path(lambda p, _: torch.from_numpy(np.asarray(flat[p]).copy()), specs)
    return family, cfg, params
