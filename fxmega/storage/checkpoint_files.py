"""What keeps a checkpoint honest on disk: a manifest of every file's size and CRC-32,
checked before anything is loaded, and a reader for DCP's ``.metadata`` that unpickles
only the classes DCP itself writes (torch's ``FileSystemReader`` uses plain
``pickle.load``, which would run whatever code a tampered file names).

Tensor payloads are read by DCP with ``torch.load(weights_only=True)``; fxmega keeps every
non-tensor value (step, config, data position, RNG) in ``meta.json``, so no other pickle
is ever loaded.
"""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fxmega.core.errors import CheckpointError
from fxmega.core.json_files import check_fields, read_object

MANIFEST = "manifest.json"
META = "meta.json"
# (module, name) pairs DCP's metadata pickle refers to, and nothing else
_ALLOWED = {
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
} | {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint metadata refers to {module}.{name}, which DCP never writes: "
                              f"refusing to unpickle it (the file is corrupted or not a DCP checkpoint)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` read by the allow-listing unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except CheckpointError:
            raise
        except Exception as e:  # truncated or garbled
            raise CheckpointError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: {e}); the "
                                  f"checkpoint is corrupted: load an earlier one") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise CheckpointError(f"{path} unpickles to {type(metadata).__name__}, not DCP's Metadata with a dict of "
                                  f"tensors: the checkpoint is corrupted; load an earlier one")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def file_digest(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": crc}


def digests(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: file_digest(folder / name) for name in names}


def write_manifest(folder: Path, files: dict[str, dict[str, int]]) -> None:
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))


def verify(folder: Path) -> None:
    """Every file the manifest lists is there, whole and unchanged; raises CheckpointError
    naming the first that is not."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}: it is not a complete fxmega checkpoint (a save that "
                              f"did not finish, or a directory copied in part)")
    files = _manifest_files(manifest)
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing (the manifest lists it with {want['bytes']:,} "
                                  f"bytes): the checkpoint is incomplete; load an earlier one")
        have = file_digest(path)
        if have["bytes"] != want["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {have['bytes']:,} bytes, the manifest says "
                                  f"{want['bytes']:,}: it is truncated or was overwritten; load an earlier one")
        if have["crc32"] != want["crc32"]:
            raise CheckpointError(f"checkpoint file {path} fails its CRC-32 check (stored {want['crc32']:#010x}, "
                                  f"read {have['crc32']:#010x}): it is corrupted; load an earlier one")


def _manifest_files(manifest: Path) -> dict[str, dict[str, int]]:
    """The manifest's ``{"files": {name: {"bytes": n, "crc32": c}}}``, its shape checked."""
    fix = "the checkpoint is corrupted; load an earlier one"
    files = read_object(manifest, CheckpointError, fix, required={"files": dict})["files"]
    for name, want in files.items():
        if Path(name).name != name or name in ("", ".", ".."):  # DCP writes flat step directories
            raise CheckpointError(f"{manifest} lists {name!r}, which is not a file name inside the checkpoint; {fix}")
        check_fields(want, f"{manifest}: entry {name!r}", CheckpointError, fix, required={"bytes": int, "crc32": int})
    return files


# the fields fxmega's loaders read from meta.json, with their types (a file from an older
# version may lack some; one that has them with another type is corrupted)
META_FIELDS = {"step": int, "params_only": bool, "skipped_steps": int, "config": dict, "model_family": str,
               "data": (str, type(None)), "mesh": str, "rng": (str, type(None)), "loss_scaler": (dict, type(None)),
               "consumed_samples": int, "task": str, "labels": list, "tokenizer": (str, type(None)),
               "imported_from": dict}


def read_meta(folder: Path) -> dict[str, Any]:
    if not (folder / META).is_file():
        raise CheckpointError(f"{folder} has no {META}: it is not a complete fxmega checkpoint")
    meta = read_object(folder / META, CheckpointError, "the checkpoint is corrupted; load an earlier one",
                       required={"step": int}, optional=META_FIELDS)
    model = meta.get("config", {}).get("model")
    if model is not None and not isinstance(model, dict):
        raise CheckpointError(f"{folder / META}: config.model is not an object; the checkpoint is corrupted")
    return meta
