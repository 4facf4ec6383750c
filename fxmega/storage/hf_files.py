"""The JSON files of a Hugging Face model directory (``config.json`` and the index of
safetensors shards), read with their shapes checked: what transformers writes, or a clear
``CheckpointError`` naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxmega.core.errors import CheckpointError
from fxmega.core.json_files import read_object


def read_config(folder: Path, fix: str) -> dict[str, Any]:
    """``folder/config.json`` as an object (its fields are checked by each family's converter)."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json: {fix}")
    return read_object(folder / "config.json", CheckpointError, fix)


def shard_names(index: Path) -> list[str]:
    """The safetensors files a ``model.safetensors.index.json`` maps tensors to, each a file
    name inside the model directory."""
    fix = "re-save the model with transformers' save_pretrained, or give a single model.safetensors"
    weight_map = read_object(index, CheckpointError, fix, required={"weight_map": dict})["weight_map"]
    names = sorted(set(weight_map.values()), key=str)
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index} maps a tensor to {name!r}, which is not a .safetensors file name in "
                                  f"{index.parent}; {fix}")
    return names
