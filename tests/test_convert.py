"""Hugging Face interop: a tiny random GPT-2, Llama, Mixtral, Qwen2-MoE and Qwen3-MoE saved by
``transformers`` import into fxmega with logits equal in float64 (1e-10), export back into directories that
``transformers`` loads with identical weights and logits, and go through the command line
and into training."""

import dataclasses
import json

import pytest
import torch

from fxmega.cli import main
from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.models import deepseek_v3, gpt, llama, mixtral
from fxmega.ops.init import init_params
from fxmega.ops.rope import RopeScaling
from fxmega.storage.convert import config_from_hf, from_hf, to_hf
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")


def _hf_gpt2():
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama():
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
                                   # SDPA, not "eager": eager attention takes its softmax in fp32 even in a
                                   # float64 model, which no float64 comparison can match to 1e-10
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _random(model):
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model.double().eval()


def _hf_mixtral():
    # 4 experts, top 2; logits compared in float64, where no two routing scores tie
    cfg = transformers.MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="sdpa",
                                     # a loop over experts: torch's grouped product takes no float64
                                     experts_implementation="eager")
    return transformers.MixtralForCausalLM(cfg)


def _hf_qwen3_moe():
    # Qwen3's own head width (32, not 64 / 4), each head's query and key RMS-normalised, a
    # dense first layer (mlp_only_layers), experts narrower than the dense MLP
    cfg = transformers.Qwen3MoeConfig(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, mlp_only_layers=[0], rope_theta=1e6, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="sdpa", experts_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(cfg)


def _hf_qwen2_moe():
    # biases on q, k and v; shared experts (2 expert widths) scaled by a sigmoid gate per
    # token; top-k weights not renormalised (Qwen1.5-MoE's norm_topk_prob=False); a dense
    # first layer
    cfg = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                                      qkv_bias=True, rope_theta=1e6, bos_token_id=0, eos_token_id=0,
                                      attn_implementation="sdpa", experts_implementation="eager")
    return transformers.Qwen2MoeForCausalLM(cfg)


def _hf_deepseek_v3():
    # MLA with odd widths (3 heads; latents 28 and 20; no-position 10 + rotary 8 query/key dims,
    # values 12), YaRN with DeepSeek's two temperatures, rotary dims interleaved as DeepSeek
    # stores them; sigmoid routing over 4 groups of 2 experts (2 groups eligible) with a
    # selection bias, a shared expert, the first layer dense
    cfg = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=28, kv_lora_rank=20, qk_nope_head_dim=10,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=128, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8,
                         "mscale_all_dim": 0.7},
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa", experts_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(cfg)
    for name, bias in model.named_buffers():  # the selection bias: a trained model's is not zero
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.linspace(-0.05, 0.05, bias.numel()))
    return model


# name -> (the transformers model, fxmega's module, fxmega's family)
MODELS = {"gpt2": (_hf_gpt2, gpt, "gpt"), "llama": (_hf_llama, llama, "llama"),
          "mixtral": (_hf_mixtral, mixtral, "mixtral"), "qwen3_moe": (_hf_qwen3_moe, mixtral, "mixtral"),
          "qwen2_moe": (_hf_qwen2_moe, mixtral, "mixtral"),
          "deepseek_v3": (_hf_deepseek_v3, deepseek_v3, "deepseek_v3")}
ROUTED_IN_FP32 = ("mixtral", "deepseek_v3")  # transformers' routers run in fp32 in a float64 model


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_with_float64_logits(name, tmp_path):
    make, module, family = MODELS[name]
    hf = _random(make())
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    got_family, cfg, params = from_hf(tmp_path / "hf", dtype=torch.float64)
    assert got_family == family
    tokens = torch.randint(0, 100, (2, 24))
    # float64 throughout, except that transformers' MoE routers take their scores and top-k
    # weights in fp32 (``router_logits.float()``): each layer's k expert weights carry a
    # relative rounding of up to 4 eps32 (the softmax or sigmoid, the top-k sum and the
    # division), so the logits may move by layers x k x 4 eps32 x their size
    atol = 1e-10 if family not in ROUTED_IN_FP32 else cfg.n_layers * cfg.moe.top_k * 1.2e-7 * 4
    with torch.no_grad():
        want = hf(tokens).logits
        torch.testing.assert_close(module.forward(params, tokens, cfg), want, rtol=0,
                                   atol=max(atol, atol * float(want.abs().max())))
    to_hf(family, cfg, params, tmp_path / "back")
    loop = {"experts_implementation": "eager"} if family in ROUTED_IN_FP32 else {}  # float64: see _hf_mixtral
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == name
    back = type(hf).from_pretrained(tmp_path / "back", torch_dtype=torch.float64, **loop).eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, want, rtol=0, atol=1e-10)


# Long-context RoPE as transformers writes it (rope_parameters): the tiny model's context of
# 32 positions stretched 4x; the test reads 64 positions, past the original context
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
             "beta_slow": 1.0},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_scaled_rope_round_trip_with_float64_logits(kind, tmp_path):
    hf_cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_parameters={"rope_theta": 10000.0, **ROPE_SCALINGS[kind]},
                                      rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    hf = _random(transformers.LlamaForCausalLM(hf_cfg))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _, cfg, params = from_hf(tmp_path / "hf", dtype=torch.float64)
    s = cfg.rope_scaling
    assert (s.kind, s.factor, s.original_max_seq_len) == (kind, 4.0, 32)
    tokens = torch.randint(0, 100, (2, 64))
    plain = llama.forward(params, tokens, dataclasses.replace(cfg, rope_scaling=RopeScaling()))
    with torch.no_grad():
        want = hf(tokens).logits
        # the same float32 frequencies and tables as transformers; everything else float64
        torch.testing.assert_close(llama.forward(params, tokens, cfg), want, rtol=0, atol=1e-10)
    # the scaling moved the logits (measured: by 4e-4) far beyond the tolerance above: not vacuous
    assert (plain - want).abs().max() > 1e-5
    to_hf("llama", cfg, params, tmp_path / "back")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", torch_dtype=torch.float64).eval()
    assert back.config.rope_parameters["rope_type"] == kind
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, want, rtol=0, atol=1e-10)


def test_unsupported_rope_scalings_are_refused():
    base = _hf_llama().config.to_dict()
    for rope, message in [({"rope_type": "linear", "factor": 2.0}, "RoPE scaling 'linear' is not implemented"),
                          ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                            "mscale": 1.0, "mscale_all_dim": 1.0}, "untruncated or mscale ramps")]:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, **rope}})
    # the older layout: rope_scaling with "type", rope_theta at the top level
    old = {**base, "rope_parameters": None, "rope_theta": 5e5,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    _, cfg = config_from_hf(old)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)


def test_command_line_import_then_train_then_export(tmp_path, capsys):
    hf = _random(_hf_gpt2()).float()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")]) == 0
    assert "tokenizer none (give --tokenizer SPEC to record one)" in capsys.readouterr().out
    model = ["--set", "model.vocab_size=100", "--set", "model.max_seq_len=32", "--set", "model.n_layers=2"]
    common = ["--config", str(ROOT / "configs/tiny_gpt.py"), *model, "--no-compile", "--no-progress", "--mock-data"]
    # fine-tune from the imported weights on tp=2 (vocab 100 is even; no padding) in one process would need ranks:
    # train on one device, which is what the import feeds
    assert main([*common, "--load", str(tmp_path / "imported"), "--steps", "2", "--save", str(tmp_path / "tuned")]) == 0
    assert "initialised the parameters from" in capsys.readouterr().out
    assert main(["convert", *common[:8], "--load", str(tmp_path / "tuned"), "--to-hf", str(tmp_path / "out")]) == 0
    tuned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    moved = sum(float((a - b).abs().sum().detach()) for a, b in zip(tuned.parameters(), hf.parameters()))
    assert 0 < moved  # two training steps changed the imported weights
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["n_layer"] == 2
    # bytes have no end-of-document id: said, not left to GPT-2's 50256, outside this 100-token vocabulary
    assert exported["bos_token_id"] is None and exported["eos_token_id"] is None
    assert tuned.generation_config.eos_token_id is None and tuned.generation_config.bos_token_id is None
    # the checkpoint records its model: exporting needs --load alone, and gives the same files
    assert main(["convert", "--load", str(tmp_path / "tuned"), "--to-hf", str(tmp_path / "again")]) == 0
    again, out = (tmp_path / d / "model.safetensors" for d in ("again", "out"))
    assert again.read_bytes() == out.read_bytes()


def test_export_states_the_tokenizers_end_of_document_id(tmp_path):
    cfg = gpt.Config(vocab_size=100, max_seq_len=32, d_model=64, n_layers=2, n_heads=4)
    params = init_params(gpt.param_specs(cfg), seed=0)
    to_hf("gpt", cfg, params, tmp_path / "gpt", eos_id=99)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "gpt")
    assert (loaded.bos_token_id, loaded.eos_token_id) == (99, 99)  # GPT-2's <|endoftext|> does both
    with pytest.raises(ConfigError, match="eos_id=50256 is outside the model's vocabulary of 100"):
        to_hf("gpt", cfg, params, tmp_path / "bad", eos_id=50256)


def test_conversion_errors(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart"}))
    with pytest.raises(ConfigError, match="model_type 'bart': fxmega converts gpt2, llama, mixtral, qwen2_moe, "
                                          "qwen3_moe, deepseek_v3, bert and t5"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_gpt2().config.to_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors .* never pickled .bin files"):
        from_hf(tmp_path)
    assert tree.leaves({}) == []


def test_command_line_deepseek_v3_both_ways(tmp_path, capsys):
    """``run.py convert --from-hf`` of a DeepseekV3ForCausalLM, then ``--to-hf`` from the
    checkpoint alone: transformers loads back the same tensors, the selection bias included."""
    hf = _random(_hf_deepseek_v3()).float()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")]) == 0
    assert main(["convert", "--load", str(tmp_path / "imported"), "--to-hf", str(tmp_path / "out")]) == 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_interleave"] is True


def test_deepseek_v3_mtp_modules_travel_as_deepseek_releases_them(tmp_path):
    """A DeepSeek-V3 with a multi-token prediction module exports it as layer ``n_layers``
    (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, the block, copies of the embedding
    and head), as the released checkpoint holds layer 61; importing reads it back exactly.
    transformers loads the main model from the same files (it drops the MTP layer) with the
    same tensors; a directory whose config counts MTP layers its files lack (transformers'
    own save) converts without them."""
    cfg = config_from_hf(_hf_deepseek_v3().config.to_dict())[1]
    cfg = dataclasses.replace(cfg, mtp_depth=1)
    params = init_params(deepseek_v3.param_specs(cfg), seed=5)
    to_hf("deepseek_v3", cfg, params, tmp_path / "out")
    family, got_cfg, got = from_hf(tmp_path / "out")
    assert (family, got_cfg.mtp_depth) == ("deepseek_v3", 1)
    assert tree.paths(got) == tree.paths(params)
    for path, want in tree.items(params):
        assert torch.equal(dict(tree.items(got))[path], want), path
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager")
    assert not any(k.startswith(f"model.layers.{cfg.n_layers}.") for k in back.state_dict())
    assert torch.equal(back.state_dict()["lm_head.weight"], params["head"].t())
    back.save_pretrained(tmp_path / "resaved", safe_serialization=True)
    assert from_hf(tmp_path / "resaved")[1].mtp_depth == 0
