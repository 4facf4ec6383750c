"""Megatron-LM's indexed dataset: a ``.bin`` file of token ids and a ``.idx`` index, byte
for byte the layout Megatron-LM's ``indexed_dataset.py`` (MMapIndexedDataset) reads and
writes, so data preprocessed for Megatron-LM trains here as it is, and the reverse.

``.idx`` layout (little-endian)::

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the token ids in .bin (see DTYPES)
    uint64    S, the number of sequences
    uint64    D, the number of entries in the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into .bin
    int64[D]  document index: sequence numbers where each document starts, then S

A document is one or more sequences (one per sentence when split into sentences; one for
the whole document otherwise). Reads are numpy memory maps: nothing is copied until a
sample is asked for, so a multi-GB ``.bin`` costs no memory to open.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from fxmega.core.errors import DataError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-LM's dtype codes (DType enum in indexed_dataset.py)
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # bytes before the arrays


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while the vocabulary fits, int32 beyond."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


class IndexedDataset:
    """Read-only view of ``prefix.bin`` / ``prefix.idx``. ``ds[i]`` is sequence ``i`` as a
    numpy array that views the memory map; ``ds.get(i, offset, length)`` a slice of it."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        idx, bin_ = index_path(prefix), data_path(prefix)
        for p in (idx, bin_):
            if not p.is_file():
                raise DataError(f"indexed dataset file {p} does not exist: --data-path takes the prefix shared by "
                                f"PREFIX.bin and PREFIX.idx (as written by `python -m fxmega.data.preprocess`)")
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_index(idx)
        self._bin_size = bin_.stat().st_size
        itemsize = self.dtype.itemsize
        if len(self.sequence_lengths):
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            if end > self._bin_size:
                raise DataError(f"{bin_} is truncated: the index {idx} points to byte {end:,} but the file has "
                                f"{self._bin_size:,} bytes; re-run the preprocessing that wrote it")
        self._bin = np.memmap(bin_, dtype=self.dtype, mode="r") if self._bin_size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def n_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._bin[start:start + n]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (the sum over its sequences), int64."""
        starts = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return starts[self.document_indices[1:]] - starts[self.document_indices[:-1]]


def _read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_FIXED)
    if len(head) < _FIXED or head[:len(HEADER)] != HEADER:
        raise DataError(f"{path} is not a Megatron indexed-dataset index: it starts with {head[:9]!r}, expected "
                        f"{HEADER!r} (a truncated or foreign file; re-run the preprocessing that wrote it)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(HEADER):])
    if version != VERSION:
        raise DataError(f"{path} has index version {version}; fxmega (like Megatron-LM) reads version {VERSION}")
    if code not in DTYPES:
        raise DataError(f"{path} names token dtype code {code}, not one of Megatron's {sorted(DTYPES)}")
    need = _FIXED + n_seq * (4 + 8) + n_doc * 8
    if size < need:
        raise DataError(f"{path} is truncated: {n_seq:,} sequences and {n_doc:,} document entries need {need:,} "
                        f"bytes, the file has {size:,}")
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=_FIXED)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=_FIXED + 4 * n_seq)
    documents = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=_FIXED + 12 * n_seq)
    if n_doc == 0 or documents[0] != 0 or documents[-1] != n_seq or np.any(np.diff(documents) < 0):
        raise DataError(f"{path} has a malformed document index (it must rise from 0 to the {n_seq:,} sequences)")
    return np.dtype(DTYPES[code]), lengths, pointers, documents


class IndexedDatasetWriter:
    """Streams sequences into ``prefix.bin`` and writes ``prefix.idx`` at ``finalize()``.

    Token ids go to disk as they arrive; only the per-sequence lengths stay in memory
    (4 bytes each). Both files are written under temporary names and renamed at the end,
    so a crash never leaves a half-written dataset under the real name."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODES or not np.issubdtype(self.dtype, np.integer):
            raise DataError(f"token dtype {self.dtype} is not an integer type with a Megatron dtype code; use one "
                            f"of uint8, int8, int16, uint16, int32, int64")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = Path(f"{self.prefix}.bin.tmp")
        self._bin = open(self._tmp_bin, "wb")
        # the index grows by 12 bytes per document (as the .idx itself does); typed arrays,
        # not lists of Python ints, which would cost ~40 bytes per entry
        self._lengths = array("i")
        self._doc_ends = array("q", [0])

    def add_sequence(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < np.iinfo(self.dtype).min or arr.max() > np.iinfo(self.dtype).max):
            raise DataError(f"token id {int(arr.max())} does not fit the dataset's {self.dtype}; "
                            f"write with a wider dtype (int32 for vocabularies over 65,500)")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        self._doc_ends.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        self.add_sequence(tokens)
        self.end_document()

    def add_documents(self, buffer: bytes, lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: their tokens as one buffer already in the
        dataset's dtype, and their lengths (the preprocessing workers' output)."""
        if len(buffer) != int(lengths.sum()) * self.dtype.itemsize:
            raise DataError(f"{len(buffer)} bytes do not hold {int(lengths.sum())} tokens of {self.dtype}")
        self._bin.write(buffer)
        first = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._doc_ends.frombytes(np.arange(first + 1, len(self._lengths) + 1, dtype=np.int64).tobytes())

    def abort(self) -> None:
        """Drop what was written (the temporary file); the real names are never touched."""
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._doc_ends, dtype=np.int64)
        if documents[-1] != len(lengths):  # sequences after the last end_document form one more document
            documents = np.append(documents, len(lengths))
        tmp_idx = Path(f"{self.prefix}.idx.tmp")
        with open(tmp_idx, "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<QBQQ", VERSION, CODES[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(tmp_idx, index_path(self.prefix))
