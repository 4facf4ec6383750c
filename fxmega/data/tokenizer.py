"""Tokenizers. The byte-level one needs no vocabulary file: every UTF-8 byte is a token."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255. Decoding replaces invalid byte sequences, which a
    sampled byte stream can contain, instead of failing."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
