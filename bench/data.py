#!/usr/bin/env python3
"""Data pipeline speed, in one run:

1. Preprocessing throughput on a real corpus (the Shakespeare plays, one document per
   paragraph) into Megatron .bin/.idx, per tokenizer and worker count, against the bare
   tokenizer (tiktoken's own batch encode in this process) as the baseline.
2. Peak memory of the preprocessing process for inputs of growing size (streaming: flat).
3. Sample-index build time against document count (10^5 ... 10^7), against the same
   algorithm as a plain Python loop (the shape of Megatron-LM's C++ helper), timed up to
   10^6 documents and extrapolated linearly beyond.

    python bench/data.py [--max-docs 10000000] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxmega.data.corpus import ensure_shakespeare  # noqa: E402
from fxmega.data.gpt_dataset import build_sample_index  # noqa: E402
from fxmega.data.preprocess import paragraph_blocks, preprocess  # noqa: E402
from fxmega.data.tokenizer import build_tokenizer  # noqa: E402

DATA = ROOT / "data"


def preprocess_table(workers: list[int], tmp: Path, copies: int) -> None:
    docs = list(paragraph_blocks(ensure_shakespeare(DATA))) * copies
    corpus = tmp / "shakespeare.jsonl"  # repeated so that starting the worker processes is amortised
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    print(f"\n1. preprocessing the Shakespeare paragraphs x {copies}: {corpus.stat().st_size / 2**20:.1f} MiB jsonl, "
          f"{len(docs):,} documents")
    print(f"{'tokenizer':<10} {'method':<28} {'tokens':>12} {'seconds':>8} {'tokens/s':>12} {'per worker':>12}")
    for spec in ("gpt2", "byte"):
        tok = build_tokenizer(spec, DATA)
        tok.encode(docs[0])  # warm up (regex compilation)
        t0 = time.perf_counter()
        if spec == "gpt2":
            label = "tiktoken encode, in a loop"
        else:
            label = "encode, in a loop"
        n = sum(len(tok.encode(d)) for d in docs)
        s = time.perf_counter() - t0
        print(f"{spec:<10} {label:<28} {n:>12,} {s:>8.2f} {n / s:>12,.0f} {n / s:>12,.0f}")
        for w in workers:
            r = preprocess([corpus], tmp / f"{spec}{w}", spec, workers=w, data_dir=DATA, progress=False)
            print(f"{spec:<10} {f'preprocess, {w} worker(s)':<28} {r['tokens']:>12,} {r['seconds']:>8.2f} "
                  f"{r['tokens_per_s']:>12,.0f} {r['tokens_per_s'] / w:>12,.0f}")


def memory_table(tmp: Path) -> None:
    corpus = ensure_shakespeare(DATA).read_text(encoding="utf-8")
    paragraphs = corpus.split("\n\n")
    print("\n2. peak memory of `python -m fxmega.data.preprocess` (byte tokenizer, 1 worker) by input size")
    print(f"{'input MiB':>10} {'documents':>10} {'peak RSS MiB':>13}")
    path = tmp / "grow.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for target in (25, 100, 200):
            while f.tell() < target * 2**20:
                for p in paragraphs:
                    f.write(json.dumps({"text": p}) + "\n")
            f.flush()
            code = ("import resource, sys; from fxmega.data.preprocess import main; "
                    f"main(['--input', {str(path)!r}, '--output-prefix', {str(tmp / 'grow')!r}, "
                    "'--tokenizer', 'byte', '--no-progress']); "
                    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
            docs = sum(1 for _ in open(path, encoding="utf-8"))
            print(f"{path.stat().st_size / 2**20:>10.0f} {docs:>10,} {int(out.stderr.split()[-1]) / 1024:>13.0f}")


def python_loop_index(lengths: np.ndarray, seq_len: int) -> int:
    """The same index with the sample starts found by a loop over documents (the shape of
    Megatron-LM's helpers.cpp, in Python); the two shuffles are numpy's, as in fxmega."""
    rng = np.random.default_rng(1)
    lengths = lengths[rng.permutation(len(lengths))]
    starts, doc, offset, remaining = [(0, 0)], 0, 0, 0
    n_samples = (int(lengths.sum()) - 1) // seq_len
    for _ in range(n_samples):
        remaining = seq_len
        while remaining > 0:
            left = int(lengths[doc]) - offset
            if left > remaining:
                offset += remaining
                remaining = 0
            else:
                remaining -= left
                doc, offset = doc + 1, 0
        starts.append((doc, offset))
    rng.permutation(n_samples)
    return len(starts)


def index_table(max_docs: int) -> None:
    seq_len = 2048
    print(f"\n3. sample-index build (shuffle + sample starts + sample shuffle), seq_len {seq_len}, one epoch")
    print(f"{'documents':>11} {'tokens':>15} {'samples':>12} {'fxmega s':>9} {'python loop s':>14}")
    rng = np.random.default_rng(0)
    loop_rate = None
    n = 10**4
    while n <= max_docs:
        lengths = np.maximum(1, rng.lognormal(6.0, 1.0, size=n)).astype(np.int64)  # ~660 tokens mean
        ids = np.arange(n, dtype=np.int64)
        t0 = time.perf_counter()
        index = build_sample_index(lengths, ids, seq_len, num_samples=(int(lengths.sum()) - 1) // seq_len, seed=1)
        built = time.perf_counter() - t0
        if n <= 10**6:
            t0 = time.perf_counter()
            python_loop_index(lengths, seq_len)
            loop_rate = (time.perf_counter() - t0) / n
            loop = f"{loop_rate * n:>14.2f}"
        else:
            loop = f"{'~' + format(loop_rate * n, '.0f'):>14}"
        print(f"{n:>11,} {int(lengths.sum()):>15,} {len(index.shuffle):>12,} {built:>9.2f} {loop}")
        n *= 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-docs", type=int, default=10**7)
    parser.add_argument("--copies", type=int, default=4, help="times the corpus is repeated for table 1")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        preprocess_table(args.workers, Path(tmp), args.copies)
        if not args.skip_memory:
            memory_table(Path(tmp))
    index_table(args.max_docs)
    print("\n~ extrapolated linearly from the 10^6 timing")


if __name__ == "__main__":
    main()
