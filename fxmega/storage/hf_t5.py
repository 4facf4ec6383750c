"""Hugging Face T5 ⇄ fxmega T5: the state-dict renaming (``t5_from_hf`` / ``t5_to_hf``,
exact inverses) and the config mapping, for ``T5ForConditionalGeneration`` (T5, T5 v1.1,
flan-t5).

Hugging Face keeps ``nn.Linear`` weights ``[out, in]``; ours are ``[in, out]`` with heads as
their own dim. The relative position tables live in Hugging Face's first layer of each stack
(``block.0.layer.0.SelfAttention.relative_attention_bias``) and in our ``relative`` group;
the encoder's final norm in ``encoder.final_layer_norm`` and in our first decoder block.
"""

from __future__ import annotations

from typing import Any

import torch

from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.models import t5

_FFN = {"relu": "relu", "gated-gelu": "gated-gelu", "gated-gelu_new": "gated-gelu"}


def _attention(get: Any, name: str, cfg: t5.Config) -> dict:
    d, h, kv = cfg.d_model, cfg.n_heads, cfg.d_kv
    out = {f"w{x}": get(f"{name}.{x}.weight").t().reshape(d, h, kv) for x in "qkv"}
    out["wo"] = get(f"{name}.o.weight").t().reshape(h, kv, d)
    return out


def _feed_forward(get: Any, name: str, cfg: t5.Config) -> dict:
    if cfg.ffn == "relu":
        return {"w_in": get(f"{name}.wi.weight").t(), "w_out": get(f"{name}.wo.weight").t()}
    return {"w_gate": get(f"{name}.wi_0.weight").t(), "w_in": get(f"{name}.wi_1.weight").t(),
            "w_out": get(f"{name}.wo.weight").t()}


def t5_from_hf(sd: dict[str, torch.Tensor], cfg: t5.Config) -> dict:
    """fxmega T5 params from a ``T5ForConditionalGeneration`` state dict."""
    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise CheckpointError(f"Hugging Face T5 tensor {name} is missing: the state dict does not hold the T5 "
                                  f"({cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, ffn {cfg.ffn}) that "
                                  f"the config describes")
        return sd[name]

    def norm(name: str) -> dict:
        return {"scale": get(f"{name}.weight")}

    blocks = []
    for i in range(cfg.n_encoder_layers):
        p = f"encoder.block.{i}.layer"
        blocks.append({"attn_norm": norm(f"{p}.0.layer_norm"), "attn": _attention(get, f"{p}.0.SelfAttention", cfg),
                       "mlp_norm": norm(f"{p}.1.layer_norm"), "mlp": _feed_forward(get, f"{p}.1.DenseReluDense", cfg)})
    for i in range(cfg.n_decoder_layers):
        p = f"decoder.block.{i}.layer"
        b = {"attn_norm": norm(f"{p}.0.layer_norm"), "attn": _attention(get, f"{p}.0.SelfAttention", cfg),
             "cross_norm": norm(f"{p}.1.layer_norm"), "cross": _attention(get, f"{p}.1.EncDecAttention", cfg)}
        if i == 0:
            b["encoder_norm"] = norm("encoder.final_layer_norm")
        blocks.append(b | {"mlp_norm": norm(f"{p}.2.layer_norm"), "mlp": _feed_forward(get, f"{p}.2.DenseReluDense",
                                                                                        cfg)})
    rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    head: dict = {"norm": norm("decoder.final_layer_norm")}
    if not cfg.tie_embeddings:
        head["w"] = get("lm_head.weight").t()
    return {"embed": {"tokens": get("shared.weight")},
            "relative": {"encoder": get(f"encoder.{rel}"), "decoder": get(f"decoder.{rel}")},
            "blocks": blocks, "head": head}


def t5_to_hf(params: dict, cfg: t5.Config) -> dict[str, torch.Tensor]:
    """The ``T5ForConditionalGeneration`` state dict of fxmega T5 params (``t5_from_hf``'s inverse)."""
    d = cfg.d_model
    sd: dict[str, torch.Tensor] = {"shared.weight": params["embed"]["tokens"],
                                   "encoder.embed_tokens.weight": params["embed"]["tokens"],
                                   "decoder.embed_tokens.weight": params["embed"]["tokens"]}

    def attention(name: str, a: dict) -> None:
        for x in "qkv":
            sd[f"{name}.{x}.weight"] = a[f"w{x}"].reshape(d, -1).t()
        sd[f"{name}.o.weight"] = a["wo"].reshape(-1, d).t()

    def feed_forward(name: str, m: dict) -> None:
        if "w_gate" in m:
            sd[f"{name}.wi_0.weight"], sd[f"{name}.wi_1.weight"] = m["w_gate"].t(), m["w_in"].t()
        else:
            sd[f"{name}.wi.weight"] = m["w_in"].t()
        sd[f"{name}.wo.weight"] = m["w_out"].t()

    blocks = params["blocks"]
    for i, b in enumerate(blocks[:cfg.n_encoder_layers]):
        p = f"encoder.block.{i}.layer"
        sd[f"{p}.0.layer_norm.weight"], sd[f"{p}.1.layer_norm.weight"] = b["attn_norm"]["scale"], b["mlp_norm"]["scale"]
        attention(f"{p}.0.SelfAttention", b["attn"])
        feed_forward(f"{p}.1.DenseReluDense", b["mlp"])
    for i, b in enumerate(blocks[cfg.n_encoder_layers:]):
        p = f"decoder.block.{i}.layer"
        for j, n in enumerate(("attn_norm", "cross_norm", "mlp_norm")):
            sd[f"{p}.{j}.layer_norm.weight"] = b[n]["scale"]
        attention(f"{p}.0.SelfAttention", b["attn"])
        attention(f"{p}.1.EncDecAttention", b["cross"])
        feed_forward(f"{p}.2.DenseReluDense", b["mlp"])
        if i == 0:
            sd["encoder.final_layer_norm.weight"] = b["encoder_norm"]["scale"]
    rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    sd[f"encoder.{rel}"], sd[f"decoder.{rel}"] = params["relative"]["encoder"], params["relative"]["decoder"]
    sd["decoder.final_layer_norm.weight"] = params["head"]["norm"]["scale"]
    sd["lm_head.weight"] = params["head"]["w"].t() if "w" in params["head"] else params["embed"]["tokens"]
    return {k: v.contiguous() for k, v in sd.items()}


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"Hugging Face T5 config {field}={value!r}: {why}")


def config_from_hf(hf: dict[str, Any], encoder_seq_len: int = 512, decoder_seq_len: int = 128) -> t5.Config:
    """``t5.Config`` from a ``config.json`` dict (``T5Config``'s defaults for missing fields);
    a ``ConfigError`` naming the field for anything this T5 cannot represent. The stream's
    lengths are training choices, not the checkpoint's: given here."""
    _require(hf.get("model_type", "t5") == "t5", "model_type", hf.get("model_type"),
             "fxmega's T5 reads model_type 't5' (mT5 and UMT5 differ: per-layer tables, other vocabularies)")
    ffn = hf.get("feed_forward_proj", "relu")
    _require(ffn in _FFN, "feed_forward_proj", ffn, f"use one of {', '.join(sorted(_FFN))}")
    n = hf.get("num_layers", 6)
    cfg = t5.Config(
        vocab_size=hf.get("vocab_size", 32128), encoder_seq_len=encoder_seq_len, decoder_seq_len=decoder_seq_len,
        d_model=hf.get("d_model", 512), n_encoder_layers=n, n_decoder_layers=hf.get("num_decoder_layers") or n,
        n_heads=hf.get("num_heads", 8), d_kv=hf.get("d_kv", 64), d_ff=hf.get("d_ff", 2048), ffn=_FFN[ffn],
        tie_embeddings=hf.get("tie_word_embeddings", True) is not False,
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), init_std=hf.get("initializer_factor", 1.0),
        pad_id=hf.get("pad_token_id", 0), eos_id=hf.get("eos_token_id", 1),
        # T5's SentencePiece vocabulary has <extra_id_0> .. <extra_id_99> at 32099 down to 32000
        # (the ids above pad the table); a vocabulary of another size: none known
        **(dict(n_sentinels=100, sentinel_start=32099) if hf.get("vocab_size", 32128) >= 32100 else
           dict(n_sentinels=0)))
    _require(hf.get("decoder_start_token_id", cfg.pad_id) == cfg.pad_id, "decoder_start_token_id",
             hf.get("decoder_start_token_id"), f"fxmega's T5 starts decoding with the pad token ({cfg.pad_id})")
    cfg.validate(prefix="t5 config")
    return cfg


def config_to_hf(cfg: t5.Config, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``T5ForConditionalGeneration`` for ``cfg``."""
    return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model, "d_kv": cfg.d_kv, "d_ff": cfg.d_ff, "num_layers": cfg.n_encoder_layers,
            "num_decoder_layers": cfg.n_decoder_layers, "num_heads": cfg.n_heads,
            "relative_attention_num_buckets": cfg.relative_buckets,
            "relative_attention_max_distance": cfg.relative_max_distance, "layer_norm_epsilon": cfg.norm_eps,
            "initializer_factor": cfg.init_std, "feed_forward_proj": cfg.ffn, "tie_word_embeddings": cfg.tie_embeddings,
            "pad_token_id": cfg.pad_id, "eos_token_id": cfg.eos_id, "decoder_start_token_id": cfg.pad_id,
            "is_encoder_decoder": True, "dropout_rate": 0.0, "torch_dtype": str(dtype).removeprefix("torch.")}
