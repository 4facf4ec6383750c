"""Text or jsonl → Megatron ``.bin/.idx``: ``python -m fxmega.data.preprocess``.

    python -m fxmega.data.preprocess --input corpus.jsonl --json-keys text \\
        --tokenizer gpt2 --output-prefix data/corpus --workers 4 --append-eod

Megatron-LM's ``tools/preprocess_data.py`` flags and output: one ``PREFIX_KEY_document``
dataset per json key (``PREFIX_text_document.bin/.idx`` for the usual ``text``). Plain
``.txt`` inputs are one document per blank-line-separated paragraph block (``--txt-docs
file`` makes each file one document). Input is streamed: worker processes tokenize
batches of documents while the main process writes them in input order, and at most a
few batches are in flight, so memory stays constant however big the input is.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fxmega.core.errors import DataError, FxmegaError
from fxmega.core.log import get_logger
from fxmega.data.indexed import IndexedDatasetWriter, token_dtype
from fxmega.data.tokenizer import build_tokenizer

BATCH_DOCS = 256  # documents per task sent to a worker

_worker: dict = {}  # per worker process: the tokenizer and the job's settings

log = get_logger(__name__)


def _init_worker(spec: str, data_dir: str, keys: list[str], append_eod: bool) -> None:
    tok = build_tokenizer(spec, data_dir)
    _worker.update(tok=tok, keys=keys, eod=tok.eod if append_eod else None, dtype=token_dtype(tok.vocab_size))


def _encode_batch(batch: list[tuple[str, int, str]]) -> tuple[dict[str, tuple[bytes, np.ndarray]], int, int]:
    """Parse and tokenize a batch of raw documents: (source, line number, json line or
    text). Returns, per key, the token ids as one buffer in the dataset's dtype and the
    per-document lengths, so the writing process only copies bytes."""
    tok, keys, eod, dtype = _worker["tok"], _worker["keys"], _worker["eod"], _worker["dtype"]
    ids: dict[str, list[int]] = {k: [] for k in keys}
    lengths: dict[str, list[int]] = {k: [] for k in keys}
    n_bytes = 0
    for source, line_no, raw in batch:
        doc = _parse(source, line_no, raw, keys)
        for key in keys:
            n_bytes += len(doc[key].encode("utf-8"))
            tokens = tok.encode(doc[key])
            if eod is not None:
                tokens.append(eod)
            ids[key].extend(tokens)
            lengths[key].append(len(tokens))
    out = {}
    for key in keys:
        arr = np.asarray(ids[key], dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
            raise DataError(f"token id {int(arr.max())} is outside the {tok.name} vocabulary of {tok.vocab_size}")
        out[key] = (arr.astype(dtype).tobytes(), np.asarray(lengths[key], dtype=np.int32))
    return out, n_bytes, len(batch)


def _parse(source: str, line_no: int, raw: str, keys: list[str]) -> dict[str, str]:
    if line_no == 0:  # plain text: the whole unit is the document, under every key
        return dict.fromkeys(keys, raw)
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{source} line {line_no} is not valid JSON ({e.msg}); jsonl holds one object per line") \
            from None
    missing = [k for k in keys if not isinstance(doc, dict) or not isinstance(doc.get(k), str)]
    if missing:
        found = sorted(doc)[:8] if isinstance(doc, dict) else type(doc).__name__
        raise DataError(f"{source} line {line_no} has no string field {missing[0]!r} (it has {found}); "
                        f"pass the right --json-keys")
    return doc


def read_documents(paths: list[Path], txt_docs: str) -> Iterator[tuple[str, int, str]]:
    """Raw documents, one at a time: (source, line number, json line) from jsonl files,
    (source, 0, text) from plain-text files. Parsing happens in the workers."""
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield str(path), n, line
        elif txt_docs == "file":
            yield str(path), 0, path.read_text(encoding="utf-8")
        else:
            for text in paragraph_blocks(path):
                yield str(path), 0, text


def paragraph_blocks(path: Path) -> Iterator[str]:
    """The blank-line-separated blocks of a text file."""
    block: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block)
                block = []
    if block:
        yield "".join(block)


def _batched(docs: Iterator, size: int) -> Iterator[list]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(inputs: list[str | Path], output_prefix: str | Path, tokenizer: str = "gpt2",
               json_keys: tuple[str, ...] = ("text",), append_eod: bool = False, workers: int = 1,
               txt_docs: str = "paragraph", data_dir: str | Path = "data", progress: bool = True) -> dict:
    """Tokenize ``inputs`` into one ``{output_prefix}_{key}_document`` dataset per key.
    Returns the counts and throughput."""
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise DataError(f"input file {p} does not exist")
    tok = build_tokenizer(tokenizer, data_dir)  # fails here, once, for a bad spec
    if append_eod and tok.eod is None:
        raise DataError(f"--append-eod: the {tok.name} tokenizer has no end-of-document token; choose one that "
                        f"has (e.g. gpt2) or leave --append-eod out")
    keys = list(json_keys)
    writers = {k: IndexedDatasetWriter(f"{output_prefix}_{k}_document", token_dtype(tok.vocab_size)) for k in keys}
    stats = {"documents": 0, "tokens": 0, "bytes": 0}
    bar = _progress(progress)
    start = time.perf_counter()
    batches = _batched(read_documents(paths, txt_docs), BATCH_DOCS)

    def consume(result: tuple[dict, int, int]) -> None:
        encoded, n_bytes, n_docs = result
        for key, (buffer, lengths) in encoded.items():
            writers[key].add_documents(buffer, lengths)
            stats["tokens"] += int(lengths.sum())
        stats["documents"] += n_docs
        stats["bytes"] += n_bytes
        if bar is not None:
            elapsed = time.perf_counter() - start
            bar.update(n_docs)
            bar.set_postfix_str(f"{stats['tokens'] / elapsed / 1e3:,.0f}k tok/s, "
                                f"{stats['bytes'] / elapsed / 2**20:,.1f} MiB/s", refresh=False)

    setup = (tokenizer, str(data_dir), keys, append_eod)
    try:
        _run(batches, consume, setup, workers)
        if stats["documents"] == 0:
            raise DataError(f"no documents in {', '.join(map(str, paths))}: nothing to write")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    for w in writers.values():
        w.finalize()
    seconds = time.perf_counter() - start
    return {**stats, "seconds": seconds, "tokens_per_s": stats["tokens"] / seconds,
            "prefixes": [f"{output_prefix}_{k}_document" for k in keys]}


def _run(batches: Iterator[list], consume, setup: tuple, workers: int) -> None:
    if workers <= 1:
        _init_worker(*setup)
        for batch in batches:
            consume(_encode_batch(batch))
        return
    with mp.get_context("spawn").Pool(workers, _init_worker, setup) as pool:
        in_flight: deque = deque()
        for batch in batches:
            in_flight.append(pool.apply_async(_encode_batch, (batch,)))
            if len(in_flight) >= 2 * workers:  # bounded: reading never runs far ahead of writing
                consume(in_flight.popleft().get())
        while in_flight:
            consume(in_flight.popleft().get())


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" docs", file=sys.stderr, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxmega.data.preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or .txt files")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer", default="gpt2", help="tokenizer spec (see fxmega.data.tokenizer)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--txt-docs", choices=["paragraph", "file"], default="paragraph",
                        help="what one document is in a .txt input")
    parser.add_argument("--data-dir", default="data", help="where fetched vocabulary files are cached")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        r = preprocess(args.input, args.output_prefix, args.tokenizer, tuple(args.json_keys), args.append_eod,
                       args.workers, args.txt_docs, args.data_dir, progress=not args.no_progress)
    except FxmegaError as e:
        log.error(str(e))
        return 2
    print(f"{r['documents']:,} documents, {r['tokens']:,} tokens in {r['seconds']:.1f} s "
          f"({r['tokens_per_s']:,.0f} tokens/s, {args.workers} workers) -> {', '.join(r['prefixes'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
