"""T5 as pure functions over one residual stream: logits equal ``transformers``'
T5ForConditionalGeneration in float64 (original T5: ReLU, tied head; T5 v1.1: gated GELU,
untied head), padded sources included; exact state-dict round trips; cached encoder–decoder
decoding equal to the full forward; T5's relative buckets; clear refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.inference.seq2seq import generate_seq2seq
from fxmega.models import t5
from fxmega.ops import init
from fxmega.sharding.mesh import MeshSpec
from fxmega.storage import convert, hf_t5
from tests.tolerance import assert_within_rounding, forward_lengths

VOCAB = 99


def _hf(ffn: str, tied: bool, decoder_layers: int = 3):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                num_decoder_layers=decoder_layers, num_heads=4, relative_attention_num_buckets=8,
                                relative_attention_max_distance=20,
                                dropout_rate=0.0, feed_forward_proj=ffn, tie_word_embeddings=tied,
                                decoder_start_token_id=0, attn_implementation="eager")
    model = transformers.T5ForConditionalGeneration(cfg)
    if not tied:  # transformers 5 ties lm_head to the embedding whatever the config says: untie it
        model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, 32))
    torch.manual_seed(0)
    for p in model.parameters():  # norms random too, so every tensor matters
        torch.nn.init.normal_(p, std=0.3)
    return model.double().eval()


def _cfg(hf, src: int) -> t5.Config:
    raw = hf.config.to_dict()
    raw["tie_word_embeddings"] = hf.lm_head.weight is hf.shared.weight
    return hf_t5.config_from_hf(raw, encoder_seq_len=src, decoder_seq_len=7)


def _batch(src: int = 13, tgt: int = 7):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (3, src), generator=g)
    targets = torch.randint(2, VOCAB, (3, tgt), generator=g)
    mask = torch.ones(3, src, dtype=torch.long)
    mask[1, 9:] = 0  # right-padded source
    return tokens, targets, mask


@pytest.mark.parametrize("ffn,tied", [("relu", True), ("gated-gelu", False)])
def test_logits_equal_transformers_float64(ffn, tied):
    hf = _hf(ffn, tied)
    tokens, targets, mask = _batch()
    cfg = _cfg(hf, tokens.shape[1])
    assert cfg.tie_embeddings is tied and cfg.ffn == ffn
    params = hf_t5.t5_from_hf(hf.state_dict(), cfg)
    decoder_inputs = t5.shift_right(targets, cfg)
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask, labels=targets).logits
        stream_mask = torch.cat([mask, torch.ones_like(targets)], dim=1)
        got = t5.forward(params, tokens, decoder_inputs, cfg, stream_mask)
        # float64 through 5 blocks of width <= 37: rounding is ~1e-14; 1e-10 leaves room, and a
        # wrong bucket, scale or norm moves logits by > 1e-2
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        # no mask: no padding
        torch.testing.assert_close(t5.forward(params, tokens, decoder_inputs, cfg),
                                   hf(input_ids=tokens, labels=targets).logits, rtol=0, atol=1e-10)


@pytest.mark.parametrize("ffn,tied", [("relu", True), ("gated-gelu", False)])
def test_state_dict_round_trip_is_exact(ffn, tied):
    hf = _hf(ffn, tied)
    sd = hf.state_dict()
    cfg = _cfg(hf, 13)
    back = hf_t5.t5_to_hf(hf_t5.t5_from_hf(sd, cfg), cfg)
    assert set(back) == set(sd)
    for key, tensor in back.items():
        assert torch.equal(tensor, sd[key]), key
    assert hf_t5.config_from_hf(hf_t5.config_to_hf(cfg, torch.float64), 13, 7) == cfg


@pytest.mark.parametrize("ffn", ["relu", "gated-gelu"])
def test_cached_decoding_equals_the_full_forward(ffn):
    cfg = t5.Config(vocab_size=VOCAB, encoder_seq_len=13, decoder_seq_len=7, d_model=32, n_encoder_layers=2,
                    n_decoder_layers=2, n_heads=4, d_kv=8, d_ff=40, ffn=ffn, tie_embeddings=ffn == "relu",
                    relative_buckets=8, relative_max_distance=20)
    params = init.init_params(t5.param_specs(cfg), seed=3, dtype=torch.float64)
    tokens, targets, mask = _batch()
    decoder_inputs = t5.shift_right(targets, cfg)
    with torch.no_grad():
        full = t5.forward(params, tokens, decoder_inputs, cfg, torch.cat([mask, torch.ones_like(targets)], dim=1))
        memory = t5.encode(params, tokens, cfg, mask)
        out, cache = t5.decode(params, decoder_inputs[:, :3], memory, cfg)  # a prompt of 3, then one at a time
        steps = [out]
        for i in range(3, decoder_inputs.shape[1]):
            out, cache = t5.decode(params, decoder_inputs[:, i:i + 1], memory, cfg, cache)
            steps.append(out)
    assert cache[0][0].shape == (3, 7, 4, 8)
    # the same sums in another order (one query at a time): float64 rounding, far below 1e-10
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def test_relative_buckets_are_t5s():
    transformers = pytest.importorskip("transformers")
    bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    pos = torch.arange(300)
    for bidirectional in (True, False):
        ours = t5.relative_buckets(pos, pos, bidirectional, 32, 128)
        theirs = bucket(pos[None, :] - pos[:, None], bidirectional=bidirectional, num_buckets=32, max_distance=128)
        assert torch.equal(ours, theirs)


def test_param_specs_are_initialised_as_transformers_does():
    cfg = t5.Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=40, n_heads=4, n_encoder_layers=1,
                    n_decoder_layers=2, tie_embeddings=False)
    specs = t5.param_specs(cfg)
    blocks = specs["blocks"]
    assert "cross" not in blocks[0] and "encoder_norm" in blocks[1] and "encoder_norm" not in blocks[2]
    assert blocks[1]["attn"]["wq"].init.std == pytest.approx((32 * 8) ** -0.5)
    assert blocks[1]["mlp"]["w_out"].init.std == pytest.approx(40 ** -0.5)
    assert specs["head"]["w"].shape == (32, VOCAB)


def test_bad_configs_and_meshes_are_refused():
    with pytest.raises(ConfigError, match="ffn='swiglu'"):
        t5.Config(ffn="swiglu").validate()
    with pytest.raises(ConfigError, match="pad_id"):
        t5.Config(vocab_size=50, pad_id=60).validate()
    with pytest.raises(ConfigError, match="feed_forward_proj"):
        hf_t5.config_from_hf({"model_type": "t5", "feed_forward_proj": "gated-silu"})
    for mesh in ("pp=2", "cp=2"):
        with pytest.raises(ConfigError, match=f"does not split over {mesh[:2]}"):
            t5.check_mesh(t5.Config(), MeshSpec.parse(mesh))


def test_greedy_generation_equals_the_full_forward_per_source():
    cfg = t5.Config(vocab_size=VOCAB, encoder_seq_len=13, decoder_seq_len=7, d_model=32, n_encoder_layers=2,
                    n_decoder_layers=2, n_heads=4, d_kv=8, d_ff=40, ffn="gated-gelu", relative_buckets=8,
                    relative_max_distance=20, pad_id=0, eos_id=1, n_sentinels=0)
    params = init.init_params(t5.param_specs(cfg), seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    sources = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    got = generate_seq2seq(t5, params, cfg, sources, 6)  # batched: padded sources, one cache
    assert max(len(ids) for ids in got) == 6  # not all stopped at once
    for source, ids in zip(sources, got):
        alone = dataclasses.replace(cfg, encoder_seq_len=len(source))
        want: list[int] = []
        for _ in range(6):  # the whole forward again for every token, no cache, no padding
            dec = torch.tensor([[cfg.pad_id, *want]])
            nxt = int(t5.forward(params, torch.tensor([source]), dec, alone)[0, -1].argmax())
            if nxt == cfg.eos_id:
                break
            want.append(nxt)
        assert ids == want
    assert generate_seq2seq(t5, params, cfg, sources, 6, temperature=1.0, seed=3) == \
        generate_seq2seq(t5, params, cfg, sources, 6, temperature=1.0, seed=3)  # seeded sampling repeats
    with pytest.raises(ValueError, match="source 0 is empty"):
        generate_seq2seq(t5, params, cfg, [[]], 4)


def test_imported_t5_generates_what_transformers_generates(tmp_path):
    # as many decoder as encoder layers: transformers' generate sizes its cache by num_layers
    hf = _hf("relu", True, decoder_layers=2)
    hf.float().save_pretrained(tmp_path / "hf")
    hf = hf.double()
    family, cfg, params = convert.from_hf(tmp_path / "hf", dtype=torch.float64)
    assert family == "t5" and cfg.tie_embeddings
    tokens, _, mask = _batch()
    ours = generate_seq2seq(t5, params, cfg, [row[m.bool()].tolist() for row, m in zip(tokens, mask)], 6)
    with torch.no_grad():
        theirs = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1)
    for row, ids in zip(theirs.tolist(), ours):
        row = row[1:]  # the start token
        assert ids == row[:row.index(cfg.eos_id)] if cfg.eos_id in row else ids == row


@pytest.mark.parametrize("tied", [True, False])
def test_exported_t5_loads_in_transformers(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = t5.Config(vocab_size=VOCAB, encoder_seq_len=13, decoder_seq_len=7, d_model=32, n_encoder_layers=2,
                    n_decoder_layers=1, n_heads=4, d_kv=8, d_ff=40, tie_embeddings=tied, relative_buckets=8,
                    relative_max_distance=20, n_sentinels=0)
    params = init.init_params(t5.param_specs(cfg), seed=7)
    convert.to_hf("t5", cfg, params, tmp_path / "out")
    back = convert.from_hf(tmp_path / "out")
    assert back[1] == dataclasses.replace(cfg, encoder_seq_len=512, decoder_seq_len=128)
    for path, tensor in tree.items(params):
        assert torch.equal(tree.get(back[2], path), tensor), path
    if not tied:  # transformers 5 ties T5's lm_head to the embedding whatever the config says
        return
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    tokens, targets, _ = _batch()
    with torch.no_grad():
        want = t5.forward(params, tokens, t5.shift_right(targets, cfg), cfg)
        got = hf(input_ids=tokens, labels=targets).logits
    # float32, the same sums in another order: the rounding bound of the forward's reductions
    assert_within_rounding(got, want, forward_lengths(cfg, tokens.shape[1] + targets.shape[1]), what="logits")
