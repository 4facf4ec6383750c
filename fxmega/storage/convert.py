"""Hugging Face ⇄ fxmega, for GPT-2, Llama and Mixtral: ``from_hf(dir)`` reads a local model
directory (``config.json`` + safetensors, one file or an index of shards) and ``to_hf``
writes one that ``transformers`` loads. The tensor renaming lives in ``hf_layout``; this
module maps the configs and does the file work.

    python run.py convert --from-hf ~/models/gpt2 --save ckpt/gpt2          # -> fxmega checkpoint
    python run.py convert --config configs/gpt2_124m.py --load ckpt/run --to-hf out/gpt2
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.core.json_files import check_fields
from fxmega.core.log import get_logger
from fxmega.data.tokenizer import portable
from fxmega.models import deepseek_v3, gpt, llama, mixtral
from fxmega.models.family import ModelConfig
from fxmega.ops.moe import MoE
from fxmega.ops.rope import RopeScaling
from fxmega.storage import checkpoint, hf_files, hf_layout, hf_t5
from fxmega.storage.checkpoint_files import digests
from fxmega.storage.hf_bert import load_hf_dir

log = get_logger(__name__)


def tensor_files(path: Path) -> list[str]:
    """The safetensors files of a Hugging Face model directory (one, or the index's shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return hf_files.shard_names(index)
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise CheckpointError(f"{path} has no model.safetensors (or an index of shards); fxmega reads safetensors "
                          f"only, never pickled .bin files: re-save the model with safe_serialization=True")


def tokenizer_spec(path: str | Path, family: str) -> str | None:
    """The tokenizer a Hugging Face model directory ships, as a ``data.tokenizer`` spec:
    GPT-2's vocab.json + merges.txt (read by tiktoken), else ``tokenizer.json``, else a
    SentencePiece ``tokenizer.model``; None when it has none of them."""
    path = Path(path)
    if family == "gpt" and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return f"gpt2-bpe:{path}"
    if (path / "tokenizer.json").is_file():
        return f"hf:{path / 'tokenizer.json'}"
    if (path / "tokenizer.model").is_file():
        return f"sentencepiece:{path / 'tokenizer.model'}"
    return None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = tensor_files(path)
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out |= load_file(str(path / name))
    return out


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# the config.json fields each converter cannot do without (the others have transformers' defaults)
_LLAMA_REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
_REQUIRED = {"gpt2": ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
             "llama": _LLAMA_REQUIRED,
             "mixtral": (*_LLAMA_REQUIRED, "num_local_experts", "num_experts_per_tok"),
             "qwen3_moe": (*_LLAMA_REQUIRED, "moe_intermediate_size", "num_experts_per_tok"),
             "qwen2_moe": (*_LLAMA_REQUIRED, "moe_intermediate_size", "num_experts_per_tok",
                           "shared_expert_intermediate_size"),
             "deepseek_v3": (*_LLAMA_REQUIRED, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")}


def config_from_hf(hf: dict[str, Any]) -> tuple[str, gpt.Config | llama.Config]:
    kind = hf.get("model_type")
    fix = "it is not a complete transformers config; re-save it with save_pretrained"
    if kind in _REQUIRED:
        check_fields(hf, f"config.json ({kind})", ConfigError, fix, required=dict.fromkeys(_REQUIRED[kind], int))
    if kind == "gpt2":
        _require(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                 f"GPT-2 activation {hf.get('activation_function')!r}: fxmega's GPT uses the tanh GELU (gelu_new)")
        return "gpt", gpt.Config(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], d_model=hf["n_embd"],
                                 n_layers=hf["n_layer"], n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 0,
                                 norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    if kind == "llama":
        return "llama", llama.Config(**_llama_fields(hf))
    if kind == "mixtral":
        _require(not hf.get("sliding_window"), f"Mixtral with sliding_window={hf.get('sliding_window')}: fxmega "
                                               f"attends over the whole context (Mixtral 8x7B's config has null)")
        _require(not hf.get("router_jitter_noise"), f"router_jitter_noise={hf.get('router_jitter_noise')}: fxmega's "
                                                    f"router adds no noise")
        moe = MoE(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                  aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
        return "mixtral", mixtral.Config(**_llama_fields(hf), moe=moe)
    if kind in ("qwen3_moe", "qwen2_moe"):
        return "mixtral", _qwen_moe_config(hf, kind)
    if kind == "deepseek_v3":
        return "deepseek_v3", _deepseek_v3_config(hf)
    raise ConfigError(f"Hugging Face model_type {kind!r}: fxmega converts gpt2, llama, mixtral, qwen2_moe, qwen3_moe, "
                      f"deepseek_v3, bert and t5")


def _deepseek_v3_config(hf: dict[str, Any]) -> deepseek_v3.Config:
    """DeepSeek-V3 as transformers configures it: MLA, sigmoid group-limited routing with the
    selection bias, shared experts, the first ``first_k_dense_replace`` layers dense, YaRN
    with DeepSeek's ``mscale`` (the tables' temperature) and ``mscale_all_dim`` (the softmax
    scale's)."""
    _require(hf.get("hidden_act", "silu") == "silu" and not hf.get("attention_bias"),
             "this DeepSeek-V3 variant (activation or attention biases) differs from fxmega's")
    h = hf["num_attention_heads"]
    _require(hf.get("num_key_value_heads", h) == h, f"num_key_value_heads={hf.get('num_key_value_heads')}: MLA gives "
                                                    f"every one of the {h} heads its own key and value")
    _require(hf.get("scoring_func", "sigmoid") == "sigmoid" and hf.get("topk_method", "noaux_tc") == "noaux_tc",
             f"routing {hf.get('scoring_func')}/{hf.get('topk_method')}: fxmega's DeepSeek-V3 routes by sigmoid "
             f"scores with the selection bias (noaux_tc)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    mscale, mscale_all_dim = float(rope.pop("mscale", 0) or 0), float(rope.pop("mscale_all_dim", 0) or 0)
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    if yarn and mscale and mscale_all_dim and "attention_factor" not in rope:
        # transformers' YaRN temperature on the tables when both are given
        rope["attention_factor"] = (deepseek_v3.yarn_mscale(rope["factor"], mscale)
                                    / deepseek_v3.yarn_mscale(rope["factor"], mscale_all_dim))
    theta, scaling = _rope_from_hf({**hf, "rope_parameters": rope, "rope_scaling": None})
    _require(not mscale_all_dim or scaling.kind == "yarn",
             f"mscale_all_dim={mscale_all_dim} with {scaling.kind} RoPE: DeepSeek-V3 scales its softmax by it under "
             f"YaRN only")
    moe = MoE(n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
              n_shared_experts=hf.get("n_shared_experts") or 0, first_dense_layers=hf.get("first_k_dense_replace", 0),
              score="sigmoid", norm_topk=bool(hf.get("norm_topk_prob", True)), n_groups=hf.get("n_group") or 1,
              topk_groups=hf.get("topk_group") or 1, route_scale=float(hf.get("routed_scaling_factor", 1.0)),
              expert_bias=True)
    return deepseek_v3.Config(
        vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 4096), d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=h, d_ff=hf["intermediate_size"],
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rope_theta=theta, rope_scaling=scaling,
        mscale_all_dim=mscale_all_dim, norm_eps=hf.get("rms_norm_eps", 1e-6), moe=moe,
        mtp_depth=hf.get("num_nextn_predict_layers") or 0)


def _deepseek_v3_to_hf(cfg: deepseek_v3.Config, torch_dtype: str) -> dict[str, Any]:
    m = cfg.moe
    _require(m.score == "sigmoid" and not m.shared_gate,
             f"this deepseek_v3 model ({m}) has features DeepseekV3ForCausalLM lacks (softmax scores, a gate on "
             f"the shared experts); it is not exported")
    rope = _rope_to_hf(cfg)  # YaRN's temperature on the tables as attention_factor, which transformers reads first
    if cfg.mscale_all_dim:
        rope["mscale_all_dim"] = cfg.mscale_all_dim
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
            "intermediate_size": cfg.d_ff, "moe_intermediate_size": m.expert_width(cfg.d_ff),
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim, "rope_interleave": True,
            "rope_parameters": rope, "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.n_shared_experts, "first_k_dense_replace": m.first_dense_layers,
            "norm_topk_prob": m.norm_topk, "n_group": m.n_groups, "topk_group": m.topk_groups,
            "routed_scaling_factor": m.route_scale, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": cfg.mtp_depth,
            "torch_dtype": torch_dtype}


def _qwen_moe_config(hf: dict[str, Any], kind: str) -> mixtral.Config:
    """Qwen-MoE as the mixtral family: Llama attention, softmax top-k routing over
    ``moe_intermediate_size`` experts, the ``mlp_only_layers`` dense. Qwen3-MoE normalises
    each head's query and key (``qk_norm``) and may give heads a width of their own
    (``head_dim``); Qwen2-MoE has biases on the query, key and value projections and shared
    experts of ``shared_expert_intermediate_size`` (whole expert widths, as one MLP) whose
    output each token scales by a sigmoid gate."""
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    _require(isinstance(n_experts, int) and n_experts > 0,
             f"config.json ({kind}) has no expert count (num_experts / num_local_experts): {n_experts!r}")
    layers = hf["num_hidden_layers"]
    dense = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    _require(step == 1 and dense == list(range(len(dense))),
             f"{kind} with decoder_sparse_step={step} and mlp_only_layers={dense}: fxmega's MoE layers follow "
             f"the first dense ones without gaps (first_dense_layers); these layers are not")
    _require(not hf.get("use_sliding_window"), f"{kind} with use_sliding_window: fxmega attends over the whole "
                                               f"context")
    f = hf["moe_intermediate_size"]
    shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    _require(kind != "qwen2_moe" or (shared > 0 and shared % f == 0),
             f"qwen2_moe with shared_expert_intermediate_size={shared} and moe_intermediate_size={f}: fxmega runs "
             f"shared experts as n whole experts of width {f} (Qwen1.5-MoE-A2.7B: 5632 = 4 x 1408)")
    moe = MoE(n_experts=n_experts, top_k=hf["num_experts_per_tok"], d_expert=f, n_shared_experts=shared // f,
              shared_gate=bool(shared), norm_topk=bool(hf.get("norm_topk_prob", False)),
              first_dense_layers=len(dense), aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    _require(len(dense) < layers, f"{kind}: all {layers} layers are in mlp_only_layers; that is a dense model")
    fields = _llama_fields({**hf, "head_dim": None})  # head_dim may be Qwen's own: d_head below
    head_dim = hf.get("head_dim") or 0
    if kind == "qwen2_moe":  # transformers' Qwen2-MoE attention has biases unless the config says not
        return mixtral.Config(**fields, d_head=head_dim, qkv_bias=bool(hf.get("qkv_bias", True)), moe=moe)
    return mixtral.Config(**fields, d_head=head_dim, qk_norm=True, moe=moe)


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``llama.Config`` fields of a Llama-shaped config.json (Llama, Mixtral)."""
    theta, scaling = _rope_from_hf(hf)
    _require(hf.get("hidden_act", "silu") == "silu" and not hf.get("attention_bias") and not hf.get("mlp_bias"),
             "this Llama variant (activation or biases) differs from fxmega's Llama")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    _require(hf.get("head_dim") in (None, d // h), f"head_dim {hf.get('head_dim')} != hidden_size / heads")
    return dict(vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 4096), d_model=d,
                n_layers=hf["num_hidden_layers"], n_heads=h, n_kv_heads=hf.get("num_key_value_heads") or h,
                d_ff=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
                norm_eps=hf.get("rms_norm_eps", 1e-5))


# RoPE scaling fields: Hugging Face's name -> fxmega's (RopeScaling), per rope_type
_ROPE_FIELDS = {"llama3": {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
                           "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor"},
                "yarn": {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
                         "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor"}}


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of a Llama config.json: transformers >= 5 keeps them in
    ``rope_parameters``, older files in ``rope_theta`` and ``rope_scaling`` (``type`` before
    ``rope_type``)."""
    rope = dict(hf.get("rope_parameters") or {})
    rope = {**(hf.get("rope_scaling") or {}), **rope}
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    _require(kind in _ROPE_FIELDS, f"Llama RoPE scaling {kind!r} is not implemented in fxmega (llama3 and yarn are): "
                                   f"rope parameters {rope}")
    _require(rope.get("partial_rotary_factor", 1.0) == 1.0 and rope.get("truncate", True)
             and not (rope.get("mscale") or rope.get("mscale_all_dim")),
             f"this {kind} RoPE (partial rotary, untruncated or mscale ramps) differs from fxmega's: {rope}")
    if kind == "yarn" and rope.get("factor") is None:  # transformers' rule: the ratio of the two contexts
        rope["factor"] = hf.get("max_position_embeddings", 4096) / rope["original_max_position_embeddings"]
    values = {ours: rope[theirs] for theirs, ours in _ROPE_FIELDS[kind].items() if rope.get(theirs) is not None}
    _require("original_max_seq_len" in values, f"{kind} RoPE without original_max_position_embeddings: {rope}")
    return theta, RopeScaling(kind=kind, **values)


def _rope_to_hf(cfg: llama.Config) -> dict[str, Any]:
    s = cfg.rope_scaling
    if s.kind == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    fields = {theirs: getattr(s, ours) for theirs, ours in _ROPE_FIELDS[s.kind].items()}
    if s.kind == "yarn" and not s.attention_factor:
        del fields["attention_factor"]  # transformers derives it from factor, as fxmega does
    return {"rope_type": s.kind, "rope_theta": cfg.rope_theta, **fields}


def config_to_hf(family: str, cfg: gpt.Config | llama.Config, dtype: torch.dtype) -> dict[str, Any]:
    torch_dtype = str(dtype).removeprefix("torch.")
    if family == "deepseek_v3":
        return _deepseek_v3_to_hf(cfg, torch_dtype)
    if family == "gpt":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_inner": cfg.d_ff or None, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
                "torch_dtype": torch_dtype}
    out = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
           "max_position_embeddings": cfg.max_seq_len, "hidden_size": cfg.d_model,
           "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.d_ff, "rope_theta": cfg.rope_theta,
           "rope_parameters": _rope_to_hf(cfg),
           "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "tie_word_embeddings": False,
           "attention_bias": False, "mlp_bias": False, "torch_dtype": torch_dtype}
    _require(family != "llama" or not (cfg.qk_norm or cfg.d_head or cfg.qkv_bias),
             "a llama with qk_norm, query/key/value biases or a head width of its own is not a LlamaForCausalLM; it "
             "is not exported")
    if family == "mixtral" and hf_kind(family, cfg) != "mixtral":
        return out | _qwen_moe_to_hf(cfg, hf_kind(family, cfg))
    if family == "mixtral":
        _require(_plain_mixtral(cfg), f"this mixtral-family model ({cfg.moe}, d_head={cfg.d_head}) has features "
                                      f"MixtralForCausalLM lacks (shared experts, dense first layers, expert width "
                                      f"or head width of its own, sigmoid or grouped routing); it is not exported")
        out |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": cfg.moe.n_experts, "num_experts_per_tok": cfg.moe.top_k,
                "router_aux_loss_coef": cfg.moe.aux_loss_coeff, "sliding_window": None, "router_jitter_noise": 0.0}
    return out


def _plain_mixtral(cfg: mixtral.Config) -> bool:
    m = cfg.moe
    return (not m.n_shared_experts and not m.first_dense_layers and m.expert_width(cfg.d_ff) == cfg.d_ff
            and m.score == "softmax" and m.norm_topk and m.n_groups == 1 and m.route_scale == 1.0
            and not m.expert_bias and not cfg.d_head and not cfg.qkv_bias)


def _qwen_moe_to_hf(cfg: mixtral.Config, kind: str) -> dict[str, Any]:
    m = cfg.moe
    f = m.expert_width(cfg.d_ff)
    routing_ok = m.score == "softmax" and m.n_groups == 1 and m.route_scale == 1.0 and not m.expert_bias
    out = {"head_dim": cfg.head_dim, "num_experts": m.n_experts, "num_experts_per_tok": m.top_k,
           "moe_intermediate_size": f, "norm_topk_prob": m.norm_topk,
           "mlp_only_layers": list(range(m.first_dense_layers)), "decoder_sparse_step": 1,
           "router_aux_loss_coef": m.aux_loss_coeff, "use_sliding_window": False, "sliding_window": None}
    if kind == "qwen3_moe":
        _require(routing_ok and not m.n_shared_experts and not cfg.qkv_bias,
                 f"this mixtral-family model with qk_norm ({m}) has features Qwen3MoeForCausalLM lacks (shared "
                 f"experts, query/key/value biases, sigmoid or grouped routing, an expert bias)")
        return out | {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    _require(routing_ok and m.n_shared_experts and m.shared_gate,
             f"this mixtral-family model ({m}) has features Qwen2MoeForCausalLM lacks (shared experts without a "
             f"gate, sigmoid or grouped routing, an expert bias)")
    return out | {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "qkv_bias": cfg.qkv_bias,
                  "shared_expert_intermediate_size": m.n_shared_experts * f}


# Hugging Face model_type -> (its state dict -> params, params -> state dict); a family
# exports as the model_type ``hf_kind`` names
_LAYOUTS = {"gpt2": (hf_layout.gpt2_from_hf, hf_layout.gpt2_to_hf),
            "llama": (hf_layout.llama_from_hf, hf_layout.llama_to_hf),
            "mixtral": (hf_layout.mixtral_from_hf, hf_layout.mixtral_to_hf),
            "qwen3_moe": (hf_layout.qwen_moe_from_hf, hf_layout.qwen_moe_to_hf),
            "qwen2_moe": (hf_layout.qwen_moe_from_hf, hf_layout.qwen_moe_to_hf),
            "deepseek_v3": (hf_layout.deepseek_v3_from_hf, hf_layout.deepseek_v3_to_hf)}


def hf_kind(family: str, cfg: ModelConfig) -> str:
    """The Hugging Face model_type fxmega writes a ``family`` model as: a mixtral-family
    model with ``qk_norm`` as Qwen3-MoE, with a gate on its shared experts as Qwen2-MoE."""
    if family == "mixtral" and cfg.qk_norm:
        return "qwen3_moe"
    if family == "mixtral" and cfg.moe.shared_gate:
        return "qwen2_moe"
    return {"gpt": "gpt2"}.get(family, family)


def from_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[str, Any, dict]:
    """(family, Config, parameter tree) from a local Hugging Face model directory (GPT-2,
    Llama, Mixtral, Qwen MoE; BERT: ``fxmega.storage.hf_bert``; T5: ``fxmega.storage.hf_t5``)."""
    path = Path(path)
    hf = hf_files.read_config(path, "give a Hugging Face model directory")
    if hf.get("model_type") == "bert":
        cfg, params = load_hf_dir(path, dtype)
        return "bert", cfg, params
    if hf.get("model_type") == "t5":
        cfg = hf_t5.config_from_hf(hf)
        sd = {k: v.to(dtype) for k, v in _read_tensors(path).items()}
        return "t5", cfg, hf_t5.t5_from_hf(sd, cfg)
    family, cfg = config_from_hf(hf)
    sd = {k: v.to(dtype) for k, v in _read_tensors(path).items()}
    if family == "deepseek_v3" and cfg.mtp_depth and f"model.layers.{cfg.n_layers}.eh_proj.weight" not in sd:
        # the config counts MTP layers the files lack: transformers' save_pretrained drops them
        log.info(f"{path}: config.json has num_nextn_predict_layers={cfg.mtp_depth} but the files hold no "
                 f"multi-token prediction layer (model.layers.{cfg.n_layers}.*; transformers drops them): converted "
                 f"without (model.mtp_depth=0)")
        cfg = dataclasses.replace(cfg, mtp_depth=0)
    # DeepSeek's rotary dims come in interleaved pairs unless the config says otherwise
    interleaved = {"interleaved": bool(hf.get("rope_interleave", True))} if family == "deepseek_v3" else {}
    try:
        params = _LAYOUTS[hf["model_type"]][0](sd, cfg, **interleaved)
    except KeyError as e:
        raise CheckpointError(f"{path}: tensor {e} is missing for a {family} model with {cfg.n_layers} "
                              f"layers") from None
    return family, cfg, params


def to_hf(family: str, cfg: ModelConfig, params: dict, path: str | Path, eos_id: int | None = None) -> Path:
    """Write ``params`` as a Hugging Face model directory (config.json + model.safetensors).
    ``eos_id``: the tokenizer's end-of-document id (None: it has none). A decoder's config
    states its special ids either way: left out, transformers would assume GPT-2's 50256 or
    Llama's 1 and 2, ids another tokenizer gives to ordinary tokens or does not have."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = tree.map_leaves(lambda t: t.detach().cpu(), params)
    _require(family in ("gpt", "llama", "mixtral", "deepseek_v3", "t5"),
             f"model family {family!r}: fxmega exports gpt, llama, mixtral, deepseek_v3 and t5 (and bert's checkpoints "
             f"are read, not written)")
    if family == "t5":
        sd = hf_t5.t5_to_hf(params, cfg)
        # one copy of the shared embedding (safetensors refuses aliases): transformers ties the rest on load
        for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            sd.pop(key)
        if cfg.tie_embeddings:
            sd.pop("lm_head.weight")
        hf = hf_t5.config_to_hf(cfg, next(iter(sd.values())).dtype)
    else:
        sd = _LAYOUTS[hf_kind(family, cfg)][1](params, cfg)
        if family == "gpt":
            sd.pop("lm_head.weight")  # tied to wte: transformers re-ties it on load
        hf = config_to_hf(family, cfg, next(iter(sd.values())).dtype)
        _require(eos_id is None or 0 <= eos_id < cfg.vocab_size,
                 f"eos_id={eos_id} is outside the model's vocabulary of {cfg.vocab_size}: the tokenizer is not this "
                 f"model's (give --tokenizer SPEC)")
        # GPT-2 begins and ends a document with the same <|endoftext|>; others' begin ids are their own
        hf |= {"bos_token_id": eos_id if family == "gpt" else None, "eos_token_id": eos_id}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path


def save_params(root: str | Path, family: str, cfg: ModelConfig, params: dict, source: str,
                tokenizer: str | None = None, data_dir: str = "data") -> Path:
    """A parameters-only fxmega checkpoint (step 0) that describes itself: its model config,
    its tokenizer (the spec ``tokenizer``, its files copied in) and, for a Hugging Face
    import, the files it read from ``source`` (size and CRC-32). ``--load`` initialises a
    run from it; generate, eval and serve need nothing else."""
    tensors = {f"params.{p}": t.detach().to(torch.float32).contiguous() for p, t in tree.items(params)}
    spec, files = portable(tokenizer, data_dir) if tokenizer else (None, {})
    meta = {"format": 1, "step": 0, "params_only": True, "model_family": family, "source": source,
            "config": {"model": dataclasses.asdict(cfg)}, "tokenizer": spec}
    folder = Path(source)
    if (folder / "config.json").is_file():
        # BERT's reader takes pytorch_model.bin too
        names = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin", *files)
        read = ["config.json", *[n for n in names if (folder / n).is_file()]]
        if (folder / names[0]).is_file():
            read += tensor_files(folder)
        meta["imported_from"] = {"dir": str(folder.resolve()), "files": digests(folder, sorted(set(read)))}
    return checkpoint.save(root, 0, tensors, meta, files=files)
