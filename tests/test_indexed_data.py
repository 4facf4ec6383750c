"""Megatron-compatible indexed datasets, GPT samples, splits, blends and the preprocessing
tool: files round trip, a file written from the format description alone reads back,
sample order is deterministic and survives resume, and bad files are clear errors."""

import json
import struct

import numpy as np
import pytest
import torch

from fxmega.cli import config_from_args, parse_args
from fxmega.config import override
from fxmega.core.errors import ConfigError, DataError
from fxmega.data.batches import SampleBatches, micro_batches
from fxmega.data.blend import blend_counts, blend_index, parse_data_path
from fxmega.data.corpus import ensure_shakespeare
from fxmega.data.gpt_dataset import GPTDataset, build_sample_index, parse_split, split_bounds
from fxmega.data.indexed import IndexedDataset, IndexedDatasetWriter
from fxmega.data.preprocess import preprocess
from fxmega.training.run import Run
from tests.conftest import ROOT


def _random_docs(n: int, seed: int = 0, vocab: int = 1000, max_len: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(0, max_len)) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16) -> IndexedDataset:
    w = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return IndexedDataset(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_index_round_trip_and_reads_are_memory_mapped(tmp_path, dtype):
    docs = _random_docs(300)
    ds = _write(tmp_path / "a", docs, dtype)
    assert len(ds) == ds.n_documents == 300 and ds.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    assert ds.n_tokens == sum(len(d) for d in docs)
    assert isinstance(ds[5].base, np.memmap) or isinstance(ds[5], np.memmap)  # a view, not a copy
    np.testing.assert_array_equal(ds.get(7, 2, 3), docs[7][2:5])


def test_documents_of_several_sequences(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "s")
    w.add_sequence([1, 2]), w.add_sequence([3]), w.end_document()  # one document, two sentences
    w.add_sequence([4, 5, 6]), w.end_document()
    w.finalize()
    ds = IndexedDataset(tmp_path / "s")
    assert len(ds) == 3 and ds.n_documents == 2
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.document_lengths().tolist() == [3, 3]


def _independent_megatron_files(prefix, sequences: list[list[int]], doc_starts: list[int]) -> None:
    """A .bin/.idx written from the format description alone (Megatron-LM's
    MMIDIDX layout), without fxmega's writer: int32 tokens, dtype code 4."""
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(struct.pack(f"<{len(s)}i", *s))
    pointers, offset = [], 0
    for s in sequences:
        pointers.append(offset)
        offset += 4 * len(s)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))  # version
        f.write(struct.pack("<B", 4))  # int32
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_starts)))
        f.write(struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences]))
        f.write(struct.pack(f"<{len(sequences)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_starts)}q", *doc_starts))


def test_reads_files_written_from_the_format_description(tmp_path):
    sequences = [[70000, 1, 2], [3], [], [4, 5, 6, 7]]
    _independent_megatron_files(tmp_path / "m", sequences, [0, 2, 4])
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and len(ds) == 4 and ds.n_documents == 2
    assert [ds[i].tolist() for i in range(4)] == sequences
    # and fxmega's writer produces the same bytes for the same content
    w = IndexedDatasetWriter(tmp_path / "f", np.int32)
    w.add_sequence(sequences[0]), w.add_sequence(sequences[1]), w.end_document()
    w.add_sequence(sequences[2]), w.add_sequence(sequences[3]), w.end_document()
    w.finalize()
    for ext in ("bin", "idx"):
        assert (tmp_path / f"f.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes()


def test_bad_files_are_clear_errors(tmp_path):
    _write(tmp_path / "ok", _random_docs(20, max_len=30))
    idx, bin_ = (tmp_path / "ok.idx").read_bytes(), (tmp_path / "ok.bin").read_bytes()
    (tmp_path / "hdr.idx").write_bytes(b"NOTANIDX!" + idx[9:]), (tmp_path / "hdr.bin").write_bytes(bin_)
    with pytest.raises(DataError, match="hdr.idx is not a Megatron indexed-dataset index"):
        IndexedDataset(tmp_path / "hdr")
    (tmp_path / "tb.idx").write_bytes(idx), (tmp_path / "tb.bin").write_bytes(bin_[:-10])
    with pytest.raises(DataError, match=r"tb.bin is truncated: the index .* points to byte"):
        IndexedDataset(tmp_path / "tb")
    (tmp_path / "ti.idx").write_bytes(idx[:-16]), (tmp_path / "ti.bin").write_bytes(bin_)
    with pytest.raises(DataError, match="ti.idx is truncated"):
        IndexedDataset(tmp_path / "ti")
    with pytest.raises(DataError, match="missing.bin does not exist|missing.idx does not exist"):
        IndexedDataset(tmp_path / "missing")
    with pytest.raises(DataError, match="token id 70000 does not fit"):
        IndexedDatasetWriter(tmp_path / "w", np.uint16).add_sequence([70000])


def test_sample_index_covers_the_shuffled_stream_exactly():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 40, size=100)
    ids = np.arange(10, 90)  # a split: sequences 10..89
    index = build_sample_index(lengths, ids, seq_len=16, num_samples=500, seed=3)
    assert len(index.shuffle) >= 500 and sorted(index.shuffle.tolist()) == list(range(len(index.shuffle)))
    epochs = len(index.order) // len(ids)  # the exposed epochs and one more for the last samples' tails
    assert epochs > 2 and all(sorted(index.order[e * 80:(e + 1) * 80]) == ids.tolist() for e in range(epochs))
    ends = np.cumsum(lengths[index.order])
    starts = ends - lengths[index.order]
    for i in range(len(index.shuffle)):  # each sample starts at token i * seq_len of the stream
        pos, off = index.starts[i]
        assert starts[pos] + off == i * 16 and off < lengths[index.order[pos]]
    again = build_sample_index(lengths, ids, 16, 500, 3)
    assert all(np.array_equal(a, b) for a, b in zip(index.__dict__.values(), again.__dict__.values()))
    # asking for more samples (training longer) keeps the first ones, in the same order
    longer = build_sample_index(lengths, ids, 16, 5000, 3)
    n = len(index.shuffle)
    assert np.array_equal(index.starts[index.shuffle], longer.starts[longer.shuffle[:n]])
    assert np.array_equal(index.order[:len(ids) * epochs], longer.order[:len(ids) * epochs])


def test_gpt_dataset_samples_and_cache(tmp_path):
    docs = _random_docs(200, max_len=40)
    ds = _write(tmp_path / "d", docs)
    a = GPTDataset(ds, "train", parse_split("90,10,0"), 16, 300, seed=5, cache_dir=tmp_path / "cache")
    stream = np.concatenate([ds[int(s)] for s in a.index.order])
    for j in range(len(a)):
        i = int(a.index.shuffle[j])
        np.testing.assert_array_equal(a[j], stream[i * 16:i * 16 + 17])
    assert len(list((tmp_path / "cache").glob("*-train-index.npz"))) == 1
    b = GPTDataset(ds, "train", parse_split("90,10,0"), 16, 300, seed=5, cache_dir=tmp_path / "cache")  # from cache
    assert all(np.array_equal(a[j], b[j]) for j in range(len(a)))
    c = GPTDataset(ds, "train", parse_split("90,10,0"), 16, 300, seed=6, cache_dir=tmp_path / "cache")
    assert not all(np.array_equal(a[j], c[j]) for j in range(20))
    valid = GPTDataset(ds, "valid", parse_split("90,10,0"), 16, 10, seed=5, cache_dir=tmp_path / "cache")
    assert set(valid.index.order.tolist()) == set(range(180, 200))  # only the valid documents
    with pytest.raises(DataError, match="the test split of .* has no documents"):
        GPTDataset(ds, "test", parse_split("90,10,0"), 16, 10, seed=5, cache_dir=tmp_path / "cache")


def test_split_sizes_follow_megatron():
    assert split_bounds(1000, parse_split("949,50,1")) == [(0, 949), (949, 999), (999, 1000)]
    assert split_bounds(10, parse_split("98,2,0")) == [(0, 10), (10, 10), (10, 10)]
    assert split_bounds(7, parse_split("1,1,1")) == [(0, 3), (3, 5), (5, 7)]  # rounding shortfall goes to train
    for bad in ("a,b", "1,2,3,4", "-1,2,0", "0,0,0"):
        with pytest.raises(ConfigError, match="data.split"):
            parse_split(bad)


def test_blend_has_exact_proportions_in_every_prefix():
    weights = [0.5, 0.3, 0.2]
    dataset, within = blend_index(weights, 1000)
    assert np.bincount(dataset).tolist() == [500, 300, 200]
    counts = np.zeros(3)
    for i, d in enumerate(dataset):
        counts[d] += 1
        assert np.all(np.abs(counts - np.asarray(weights) * (i + 1)) <= 1)
    for d in range(3):  # each dataset's samples are taken in order, once each
        assert within[dataset == d].tolist() == list(range(np.sum(dataset == d)))
    assert blend_counts([1 / 3, 1 / 3, 1 / 3], 10).sum() == 10
    assert parse_data_path("0.7 a 0.3 b") == [(0.7, "a"), (0.3, "b")]
    for bad, msg in [("0.7 a 0.3", "alternates weight and prefix"), ("x a 1 b", "is not a number"),
                     ("0 a 1 b", "must be positive")]:
        with pytest.raises(ConfigError, match=msg):
            parse_data_path(bad)


def test_preprocess_jsonl_with_workers_equals_one_process(tmp_path):
    texts = [f"document {i}: " + "to be or not to be " * (i % 7) for i in range(600)]
    with open(tmp_path / "in.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "title": f"t{i}"}) + "\n")
    one = preprocess([tmp_path / "in.jsonl"], tmp_path / "one", "byte", ("text", "title"), progress=False)
    two = preprocess([tmp_path / "in.jsonl"], tmp_path / "two", "byte", ("text", "title"), workers=2,
                     progress=False)
    assert one["documents"] == two["documents"] == 600
    for key in ("text", "title"):
        for ext in ("bin", "idx"):
            assert (tmp_path / f"one_{key}_document.{ext}").read_bytes() == \
                   (tmp_path / f"two_{key}_document.{ext}").read_bytes()
    ds = IndexedDataset(tmp_path / "one_text_document")
    assert bytes(ds[3].astype(np.uint8)).decode() == texts[3] and len(ds) == 600


def test_preprocess_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{not json}\n')
    with pytest.raises(DataError, match="bad.jsonl line 2 is not valid JSON"):
        preprocess([tmp_path / "bad.jsonl"], tmp_path / "o", "byte", progress=False)
    (tmp_path / "key.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(DataError, match="has no string field 'text'.*--json-keys"):
        preprocess([tmp_path / "key.jsonl"], tmp_path / "o", "byte", progress=False)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no documents"):
        preprocess([tmp_path / "empty.txt"], tmp_path / "o", "byte", progress=False)
    with pytest.raises(DataError, match="byte tokenizer has no end-of-document token"):
        preprocess([tmp_path / "key.jsonl"], tmp_path / "o", "byte", append_eod=True, progress=False)
    assert not list(tmp_path.glob("o_*.idx"))  # nothing half-written under the real names


@pytest.fixture(scope="module")
def shakespeare_prefix(tmp_path_factory):
    """The Shakespeare corpus as a byte-level indexed dataset (paragraphs as documents)."""
    out = tmp_path_factory.mktemp("indexed") / "shakespeare"
    r = preprocess([ensure_shakespeare(ROOT / "data")], out, "byte", progress=False)
    return r["prefixes"][0]


def _indexed_cfg(tiny_gpt, source, tmp_path, *extra):
    return override(tiny_gpt, [f"data.source={source}", "data.tokenizer=byte", f"data.cache_dir={tmp_path}",
                               "train.compile=false", "train.steps=6", *extra])


def test_training_on_indexed_data_learns_and_resumes_in_order(tiny_gpt, shakespeare_prefix, tmp_path):
    cfg = _indexed_cfg(tiny_gpt, shakespeare_prefix, tmp_path / "cache")
    straight = Run(cfg)
    assert straight.data.description.startswith(f"indexed {shakespeare_prefix}")
    expected = [straight.do_step()["loss"] for _ in range(6)]
    assert expected[-1] < expected[0]
    first = Run(cfg)
    losses = [first.do_step()["loss"] for _ in range(3)]
    first.save(str(tmp_path / "ckpt"))
    second = Run(cfg)
    assert second.resume(str(tmp_path / "ckpt")) and second.step == 3
    losses += [second.do_step()["loss"] for _ in range(3)]
    assert losses == expected  # same samples in the same order after the restart


def test_blended_training_draws_each_dataset_by_weight(tiny_gpt, shakespeare_prefix, tmp_path):
    other = _write(tmp_path / "numbers", [np.full(100, 7 + i % 3) for i in range(50)], np.uint16).prefix
    args = parse_args(["--config", str(ROOT / "configs/tiny_gpt.py"),
                                      "--data-path", "0.75", shakespeare_prefix, "0.25", other])
    cfg = config_from_args(args)
    assert cfg.data.source == f"0.75 {shakespeare_prefix} 0.25 {other}"
    run = Run(_indexed_cfg(tiny_gpt, cfg.data.source, tmp_path / "cache", "train.steps=10"))
    batches = [run.train_data.global_batch(s, 8)["inputs"] for s in range(10)]
    from_numbers = sum(int(torch.all((b >= 7) & (b <= 9))) for batch in batches for b in batch)
    assert from_numbers == 20  # exactly a quarter of the 80 samples


def test_every_mesh_sees_the_same_samples(tiny_gpt, shakespeare_prefix, tmp_path):
    run = Run(_indexed_cfg(tiny_gpt, shakespeare_prefix, tmp_path / "cache", "train.global_batch_size=8",
                           "train.micro_batch_size=2"))
    batch = run.train_data.global_batch(2, 8)
    for dp in (1, 2, 4):
        per_rank = [micro_batches(batch, 2, r, dp) for r in range(dp)]
        seen = torch.cat([m["inputs"] for step in zip(*per_rank) for m in step])
        assert torch.equal(seen, batch["inputs"])  # the global batch, in order, split over ranks


def test_token_ids_beyond_the_vocabulary_are_rejected(tmp_path):
    ds = _write(tmp_path / "big", [np.arange(250, 300) for _ in range(5)])  # every window holds ids > 255
    data = SampleBatches(GPTDataset(ds, "train", (1.0, 0.0, 0.0), 16, 4, 0, tmp_path / "c"), 256, "train")
    with pytest.raises(DataError, match=r"token id 29\d in the train data is outside model.vocab_size=256"):
        data.global_batch(0, 4)


@pytest.mark.slow
def test_data_source_errors(tiny_gpt, tmp_path):
    with pytest.raises(DataError, match="neither a text file nor the prefix of an indexed dataset"):
        Run(_indexed_cfg(tiny_gpt, str(tmp_path / "nothing"), tmp_path))
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller than the gpt2 tokenizer's 50,257"):
        Run(override(tiny_gpt, ["data.source=shakespeare", f"data.data_dir={ROOT / 'data'}", "data.tokenizer=gpt2"]))


@pytest.mark.slow
def test_command_line_preprocess_then_train(tmp_path, capsys):
    from fxmega.cli import main as run_main
    from fxmega.data.preprocess import main as preprocess_main

    lines = [json.dumps({"text": f"Line {i}: the quick brown fox jumps over the lazy dog. " * 4}) for i in range(40)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    assert preprocess_main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "c"),
                            "--tokenizer", "gpt2", "--data-dir", str(ROOT / "data"), "--append-eod",
                            "--workers", "2", "--no-progress"]) == 0
    ds = IndexedDataset(tmp_path / "c_text_document")
    assert len(ds) == 40 and all(int(ds[i][-1]) == 50256 for i in range(40))  # --append-eod
    assert ds[0][:2].tolist() == [13949, 657]  # "Line 0" in GPT-2 BPE
    assert "40 documents" in capsys.readouterr().out
    code = run_main(["--config", str(ROOT / "configs/tiny_gpt.py"), "--data-path", str(tmp_path / "c_text_document"),
                     "--tokenizer", "gpt2", "--split", "90,10,0", "--no-compile", "--no-progress", "--steps", "2",
                     "--set", "model.vocab_size=50304", "--set", f"data.data_dir={ROOT / 'data'}",
                     "--data-cache-path", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert code == 0 and "data: indexed" in out and "validation loss" in out


def test_an_empty_dataset_is_a_clear_error(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "empty")
    w.finalize()
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.n_documents == 0
    with pytest.raises(DataError, match="the train split of .*empty has no documents"):
        GPTDataset(ds, "train", parse_split("949,50,1"), 16, 10, 0, tmp_path / "c")
    only_empty_docs = _write(tmp_path / "zeros", [np.zeros(0, np.int64)] * 3)
    with pytest.raises(DataError, match="the split holds 0 tokens, fewer than one sample"):
        GPTDataset(only_empty_docs, "train", (1.0, 0.0, 0.0), 16, 10, 0, tmp_path / "c")
