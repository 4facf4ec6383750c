"""Model architecture: exact parameter counts, shapes on meta tensors, and logits equal to
the Hugging Face implementations of GPT-2 and Llama."""

import pytest
import torch

from fxmega.config import from_dict, load, override, to_dict
from fxmega.core.errors import ConfigError
from fxmega.models import gpt, llama, model_for
from fxmega.ops.init import count_params, init_params
from fxmega.planning.summary import check_shapes, summary
from fxmega.storage import hf_layout
from tests.conftest import ROOT
from tests.tolerance import assert_within_rounding

PUBLISHED_COUNTS = {
    "gpt2_124m.py": 124_439_808,
    "gpt2_xl.py": 1_557_611_200,
    "llama2_7b.py": 6_738_415_616,
    "llama3_8b.py": 8_030_261_248,
    "llama31_8b.py": 8_030_261_248,  # Llama 3's shape; the context comes from RoPE scaling
}


@pytest.mark.parametrize("name,expected", PUBLISHED_COUNTS.items())
def test_parameter_counts_match_published_models(name, expected):
    cfg = load(ROOT / "configs" / name)
    assert count_params(model_for(cfg.model).param_specs(cfg.model)) == expected


def test_rope_scaling_in_configs_overrides_and_checkpoints():
    cfg = load(ROOT / "configs" / "llama31_8b.py")
    assert from_dict(to_dict(cfg)) == cfg  # what a checkpoint's meta.json carries comes back
    yarn = override(cfg, ["model.rope_scaling.kind=yarn", "model.rope_scaling.factor=4"])
    assert yarn.model.rope_scaling.kind == "yarn" and yarn.model.rope_scaling.factor == 4.0
    yarn.model.validate()
    positions = torch.arange(0, 131072, 4096)
    scaled, plain = cfg.model.rope.tables(positions, 128), llama.Config(rope_theta=5e5).rope.tables(positions, 128)
    assert not torch.allclose(scaled[0], plain[0])  # the slow dims turn 8x slower
    with pytest.raises(ConfigError, match="rope_scaling.kind='ntk': choose one of none, llama3, yarn"):
        override(cfg, ["model.rope_scaling.kind=ntk"]).model.validate()
    with pytest.raises(ConfigError, match="original_max_seq_len=0: give the context"):
        override(cfg, ["model.rope_scaling.original_max_seq_len=0"]).model.validate()


def test_every_param_names_every_dim():
    for cfg in (gpt.Config(), llama.Config(n_kv_heads=8)):
        from fxmega.core import tree

        for path, spec in tree.items(model_for(cfg).param_specs(cfg)):
            assert len(spec.axes) == len(spec.shape), path
            assert all(isinstance(a, str) and a for a in spec.axes), path


def test_shapes_check_on_meta_without_allocating():
    cfg = load(ROOT / "configs" / "llama3_8b.py").model
    assert check_shapes(cfg, seq_len=128, batch=2) == (2, 128, 128256)


def test_summary_prints_total_and_flops():
    text = summary(gpt.Config(), seq_len=1024)
    assert "parameters: 124,439,808" in text
    assert "855,166,464" in text


def _randomize(module, std=0.1):
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module.eval()


def test_gpt2_logits_equal_transformers():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    hf = _randomize(transformers.GPT2LMHeadModel(hf_cfg)).double()  # float64: only the orders of sums differ
    cfg = gpt.Config(vocab_size=100, max_seq_len=32, d_model=64, n_layers=2, n_heads=4)
    params = hf_layout.gpt2_from_hf(hf.state_dict(), cfg)
    tokens = torch.randint(0, 100, (2, 16))
    # per block: d_model, d_ff=256 and 16 positions; then d_model and the vocabulary
    assert_within_rounding(gpt.forward(params, tokens, cfg), hf(tokens).logits, (2 * (64 + 256 + 16), 64 + 100),
                           dtype=torch.float64, what="logits")
    back = hf_layout.gpt2_to_hf(params, cfg)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_llama_logits_equal_transformers():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="eager",
                                      bos_token_id=0, eos_token_id=0)
    hf = _randomize(transformers.LlamaForCausalLM(hf_cfg)).double()  # float64: only the orders of sums differ
    cfg = llama.Config(vocab_size=100, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       d_ff=96, rope_theta=500000.0)
    params = hf_layout.llama_from_hf(hf.state_dict(), cfg)
    tokens = torch.randint(0, 100, (2, 24))
    # transformers builds the RoPE cos/sin tables in float32 whatever the model's dtype, so
    # the angles pos x theta of 24 positions carry float32 rounding; everything else is float64
    assert_within_rounding(llama.forward(params, tokens, cfg), hf(tokens).logits, 24, dtype=torch.float32,
                           what="logits")
    back = hf_layout.llama_to_hf(params, cfg)
    assert set(back) == set(hf.state_dict())
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_forward_is_causal(tiny_llama):
    cfg = tiny_llama.model
    params = init_params(llama.param_specs(cfg), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % cfg.vocab_size
    a, b = llama.forward(params, tokens, cfg), llama.forward(params, changed, cfg)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
