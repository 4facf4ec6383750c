"""The translation recipe's pieces: parallel text in both formats with clear errors, batches
that visit every pair once per epoch, T5 fine-tuning on pairs through the same Run, and the
evaluation's BLEU and chrF equal to sacrebleu's on the same outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fxmega.config import load, override
from fxmega.core.errors import ConfigError, DataError
from fxmega.data.parallel_text import PairBatches, read_pairs, seq2seq_batch
from fxmega.data.po_catalogues import pairs_from_po, split_of
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.inference.chat import chat_answerer
from fxmega.inference.model_loader import LoadedModel
from fxmega.inference.seq2seq import WithModelSpecials
from fxmega.inference.translation_eval import evaluate_translation, seq2seq_translator
from fxmega.models import model_for, t5
from fxmega.ops import init
from fxmega.training.run import Run
from tests.multirank import ROOT

T5 = ROOT / "configs" / "tiny_t5.py"
WORDS = "the cat dog sat ran on a mat log big small red".split()


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """A toy translation: the words reversed (learnable, and not a copy)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = list(rng.choice(WORDS, rng.integers(2, 5)))
        out.append((" ".join(words), " ".join(reversed(words))))
    return out


def test_parallel_text_in_both_formats(tmp_path):
    pairs = _pairs(5)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"src": s, "tgt": t}) for s, t in pairs) + "\n")
    (tmp_path / "s.txt").write_text("\n".join(s for s, _ in pairs))
    (tmp_path / "t.txt").write_text("\n".join(t for _, t in pairs))
    assert read_pairs(tmp_path / "p.jsonl") == pairs == read_pairs(f"{tmp_path / 's.txt'},{tmp_path / 't.txt'}")
    (tmp_path / "t2.txt").write_text("one\n")
    with pytest.raises(DataError, match="has 5 lines but .* has 1"):
        read_pairs(f"{tmp_path / 's.txt'},{tmp_path / 't2.txt'}")
    (tmp_path / "bad.jsonl").write_text('{"src": "a"}\n')
    with pytest.raises(DataError, match='bad.jsonl:1: expected a JSON object with "src" and "tgt"'):
        read_pairs(tmp_path / "bad.jsonl")


def test_pair_batches_visit_every_pair_once_per_epoch_and_keep_eos():
    pairs = [([i, i + 1], [i] * 9) for i in range(10)]
    batches = PairBatches(pairs, 4, 5, pad=0, eos=99, seed=1, split="train")
    assert sorted(batches.rows(0, 5) + batches.rows(1, 5)) == list(range(10))  # one epoch
    assert len(set(batches.rows(0, 4) + batches.rows(1, 4))) == 8  # no pair twice within an epoch
    assert batches.rows(0, 4) == PairBatches(pairs, 4, 5, 0, 99, 1, "train").rows(0, 4)  # a pure function
    b = seq2seq_batch([([5, 6, 7, 8, 9], [1, 2])], 4, 5, pad=0, eos=99)
    assert b["inputs"].tolist() == [[5, 6, 7, 99]]  # cut, the EOS kept
    assert b["targets"].tolist() == [[1, 2, 99, 0, 0]] and b["decoder_inputs"].tolist() == [[0, 1, 2, 99, 0]]
    assert b["loss_mask"].tolist() == [[1, 1, 1, 0, 0]] and b["attention_mask"].tolist() == [[1] * 4 + [1, 1, 1, 0, 0]]


def test_po_catalogues_are_parsed_and_split_by_source():
    pytest.importorskip("polib")
    po = '''msgid ""
msgstr "Content-Type: text/plain; charset=UTF-8\\n"

msgid "Save"
msgstr "Enregistrer"

#, fuzzy
msgid "Delete"
msgstr "Supprimer"

msgid "Untranslated"
msgstr ""

msgid "%(count)s item"
msgid_plural "%(count)s items"
msgstr[0] "%(count)s élément"
msgstr[1] "%(count)s éléments"
'''
    assert pairs_from_po(po) == [("Save", "Enregistrer"), ("%(count)s item", "%(count)s élément")]
    splits = [split_of(f"string {i}") for i in range(2000)]
    assert 0.87 < splits.count("train") / 2000 < 0.93 and split_of("Save") == split_of("Save")


def test_t5_fine_tunes_on_pairs(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"src": s, "tgt": t}) for s, t in _pairs(200)))
    cfg = override(load(T5), ["data.task=seq2seq", f"data.source={tmp_path / 'train.jsonl'}", "train.compile=false",
                              "train.device=cpu", "model.decoder_seq_len=24", "train.steps=30"])
    run = Run(cfg)
    assert len(run.data.valid.pairs) > 0  # held out by hash: valid_fraction of the 200
    losses = [run.do_step()["loss"] for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    with pytest.raises(ConfigError, match="data.task=seq2seq reads pairs"):
        Run(override(load(T5), ["data.task=seq2seq", "train.compile=false"]))
    with pytest.raises(ConfigError, match="trains an encoder-decoder"):
        Run(override(load(ROOT / "configs" / "tiny_gpt.py"), ["data.task=seq2seq", f"data.source={tmp_path}"]))


def test_evaluation_scores_are_sacrebleus():
    sacrebleu = pytest.importorskip("sacrebleu")
    cfg = override(load(T5), []).model
    params = init.init_params(t5.param_specs(cfg), seed=0)
    pairs = _pairs(6)
    # the untrained model may write sentinels: the tokenizer that reads and writes them
    translate = seq2seq_translator(t5, params, cfg, WithModelSpecials(ByteTokenizer(), cfg), max_new_tokens=8)
    result = evaluate_translation(translate, pairs)
    refs = [[t for _, t in pairs]]
    assert len(result["hypotheses"]) == 6
    assert result["bleu"] == sacrebleu.corpus_bleu(result["hypotheses"], refs).score
    assert result["chrf"] == sacrebleu.corpus_chrf(result["hypotheses"], refs).score
    assert result["copy_bleu"] == sacrebleu.corpus_bleu([s for s, _ in pairs], refs).score


def test_chat_answerer_fits_prompt_and_answer_in_the_context():
    """A decoder-only translator answers sources of any length: a prompt longer than half the
    context has its source cut, and each batch generates only what is left of it."""
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.device=cpu"])  # max_seq_len 64
    model = model_for(cfg.model)
    specs = model.param_specs(cfg.model)
    run = LoadedModel(cfg, model, specs, specs, init.init_params(specs, seed=0), None, torch.device("cpu"),
                      ByteTokenizer())
    sources = ["short", "a source far longer than the whole context of this tiny model " * 3]
    out = chat_answerer(run, max_new_tokens=100)(sources)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
