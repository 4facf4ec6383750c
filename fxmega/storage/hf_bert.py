"""Hugging Face BERT ⇄ fxmega BERT: the state-dict renaming (``bert_from_hf`` /
``bert_to_hf``, exact inverses), the config mapping, and reading a local model directory.

Hugging Face keeps ``nn.Linear`` weights ``[out, in]``; ours are ``[in, out]`` with heads as
their own dim, so weights are transposed and reshaped. Keys may carry the ``bert.`` prefix
of ``BertForMaskedLM`` / ``BertForPreTraining`` or be bare (``BertModel``); keys that are
not ours (``cls.seq_relationship``, a classifier, the ``position_ids`` buffer) are ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.models import bert
from fxmega.storage import hf_files

# Which Hugging Face classes hold the pooler and the MLM head (``cls.predictions``); the
# others build their ``BertModel`` with ``add_pooling_layer=False`` or have no MLM head.
_POOLED = ("BertModel", "BertForPreTraining", "BertForNextSentencePrediction", "BertForSequenceClassification",
           "BertForMultipleChoice")
_MLM = ("BertForPreTraining", "BertForMaskedLM")


def _normalise_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bare keys (``bert.`` dropped), and the old ``LayerNorm.gamma/beta`` names as
    ``weight/bias`` (checkpoints converted from the original TensorFlow release)."""
    out = {}
    for key, value in sd.items():
        key = key.removeprefix("bert.")
        if ".LayerNorm." in key and key.endswith((".gamma", ".beta")):
            stem, old = key.rsplit(".", 1)
            key = f"{stem}.{'weight' if old == 'gamma' else 'bias'}"
        out[key] = value
    return out


def bert_from_hf(sd: dict[str, torch.Tensor], cfg: bert.Config) -> dict:
    """fxmega BERT params from a ``BertModel`` / ``BertForMaskedLM`` / ``BertForPreTraining``
    state dict; ``cfg.pooler`` and ``cfg.mlm_head`` say which optional parts to read."""
    sd = _normalise_keys(sd)
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.head_dim

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            where = name if name.startswith("cls.") else f"{name} (or bert.{name})"
            raise CheckpointError(f"Hugging Face BERT tensor {where} is missing: the state dict does not hold the "
                                  f"{cfg.n_layers}-layer BERT (pooler={cfg.pooler}, mlm_head={cfg.mlm_head}) "
                                  f"that the config describes")
        return sd[name]

    def norm(name: str) -> dict:
        return {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}

    def dense(name: str) -> dict:
        return {"w": get(f"{name}.weight").t(), "b": get(f"{name}.bias")}

    blocks = []
    for i in range(cfg.n_layers):
        p = f"encoder.layer.{i}"
        attn = {}
        for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
            attn[f"w{ours}"] = get(f"{p}.attention.self.{theirs}.weight").t().reshape(d, h, hd)
            attn[f"b{ours}"] = get(f"{p}.attention.self.{theirs}.bias").reshape(h, hd)
        attn["wo"] = get(f"{p}.attention.output.dense.weight").t().reshape(h, hd, d)
        attn["bo"] = get(f"{p}.attention.output.dense.bias")
        blocks.append({
            "attn": attn,
            "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
            "mlp": {
                "w_in": get(f"{p}.intermediate.dense.weight").t(), "b_in": get(f"{p}.intermediate.dense.bias"),
                "w_out": get(f"{p}.output.dense.weight").t(), "b_out": get(f"{p}.output.dense.bias"),
            },
            "mlp_norm": norm(f"{p}.output.LayerNorm"),
        })
    params: dict = {
        "embed": {
            "tokens": get("embeddings.word_embeddings.weight"),
            "positions": get("embeddings.position_embeddings.weight"),
            "token_types": get("embeddings.token_type_embeddings.weight"),
            "norm": norm("embeddings.LayerNorm"),
        },
        "blocks": blocks,
    }
    if cfg.pooler:
        params["pooler"] = dense("pooler.dense")
    if cfg.mlm_head:
        t = "cls.predictions.transform"
        params["mlm"] = {**dense(f"{t}.dense"), "norm": norm(f"{t}.LayerNorm"), "b_vocab": get("cls.predictions.bias")}
    return params


def bert_to_hf(params: dict, cfg: bert.Config) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict from fxmega BERT params: ``BertForMaskedLM`` /
    ``BertForPreTraining`` keys (``bert.`` prefixed, plus ``cls.predictions``) when the MLM
    head is there, bare ``BertModel`` keys otherwise. The tied decoder weight and bias are
    left out, as ``save_pretrained`` does; ``transformers`` re-ties them on load."""
    d = cfg.d_model
    pre = "bert." if cfg.mlm_head else ""
    e = params["embed"]
    sd = {
        f"{pre}embeddings.word_embeddings.weight": e["tokens"],
        f"{pre}embeddings.position_embeddings.weight": e["positions"],
        f"{pre}embeddings.token_type_embeddings.weight": e["token_types"],
        f"{pre}embeddings.LayerNorm.weight": e["norm"]["scale"],
        f"{pre}embeddings.LayerNorm.bias": e["norm"]["bias"],
    }
    for i, b in enumerate(params["blocks"]):
        p = f"{pre}encoder.layer.{i}"
        a, m = b["attn"], b["mlp"]
        for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
            sd[f"{p}.attention.self.{theirs}.weight"] = a[f"w{ours}"].reshape(d, d).t()
            sd[f"{p}.attention.self.{theirs}.bias"] = a[f"b{ours}"].reshape(d)
        sd |= {
            f"{p}.attention.output.dense.weight": a["wo"].reshape(d, d).t(),
            f"{p}.attention.output.dense.bias": a["bo"],
            f"{p}.attention.output.LayerNorm.weight": b["attn_norm"]["scale"],
            f"{p}.attention.output.LayerNorm.bias": b["attn_norm"]["bias"],
            f"{p}.intermediate.dense.weight": m["w_in"].t(),
            f"{p}.intermediate.dense.bias": m["b_in"],
            f"{p}.output.dense.weight": m["w_out"].t(),
            f"{p}.output.dense.bias": m["b_out"],
            f"{p}.output.LayerNorm.weight": b["mlp_norm"]["scale"],
            f"{p}.output.LayerNorm.bias": b["mlp_norm"]["bias"],
        }
    if cfg.pooler:
        sd[f"{pre}pooler.dense.weight"] = params["pooler"]["w"].t()
        sd[f"{pre}pooler.dense.bias"] = params["pooler"]["b"]
    if cfg.mlm_head:
        m = params["mlm"]
        sd |= {
            "cls.predictions.transform.dense.weight": m["w"].t(),
            "cls.predictions.transform.dense.bias": m["b"],
            "cls.predictions.transform.LayerNorm.weight": m["norm"]["scale"],
            "cls.predictions.transform.LayerNorm.bias": m["norm"]["bias"],
            "cls.predictions.bias": m["b_vocab"],
        }
    return {k: v.contiguous() for k, v in sd.items()}


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"Hugging Face BERT config {field}={value!r}: {why}")


def config_from_hf(hf: dict[str, Any]) -> bert.Config:
    """``bert.Config`` from a ``config.json`` dict; a ``ConfigError`` naming the field for
    anything this BERT cannot represent. Missing fields take ``BertConfig``'s defaults. The
    pooler and MLM head follow ``architectures`` (``BertModel``'s when it is absent);
    ``load_hf_dir`` then sets them from the tensors actually present."""
    _require(hf.get("model_type", "bert") == "bert", "model_type", hf.get("model_type"),
             "fxmega's BERT reads only model_type 'bert' (RoBERTa, ALBERT, DistilBERT... differ in layout)")
    _require(hf.get("position_embedding_type", "absolute") in ("absolute", None), "position_embedding_type",
             hf.get("position_embedding_type"), "fxmega's BERT has learned absolute positions only; relative position "
             "embeddings are not implemented")
    _require(hf.get("hidden_act", "gelu") == "gelu", "hidden_act", hf.get("hidden_act"),
             "fxmega's BERT uses the exact erf GELU ('gelu'); another activation would change every output")
    _require(not hf.get("is_decoder"), "is_decoder", hf.get("is_decoder"),
             "fxmega's BERT is a bidirectional encoder; a causal BERT decoder is not implemented")
    _require(not hf.get("add_cross_attention"), "add_cross_attention", hf.get("add_cross_attention"),
             "cross-attention (encoder-decoder BERT) is not implemented")
    _require(hf.get("tie_word_embeddings", True) is not False, "tie_word_embeddings", False,
             "fxmega's MLM head is tied to the word embeddings; an untied decoder is not implemented")
    d = hf.get("hidden_size", 768)
    _require(hf.get("embedding_size", d) == d, "embedding_size", hf.get("embedding_size"),
             f"the embeddings must be hidden_size={d} wide (a factorised embedding is ALBERT's, not BERT's)")
    archs = hf.get("architectures") or ["BertModel"]
    cfg = bert.Config(
        vocab_size=hf.get("vocab_size", 30522), max_seq_len=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2), d_model=d, n_layers=hf.get("num_hidden_layers", 12),
        n_heads=hf.get("num_attention_heads", 12), d_ff=hf.get("intermediate_size", 3072),
        norm_eps=hf.get("layer_norm_eps", 1e-12), init_std=hf.get("initializer_range", 0.02),
        pooler=any(a in _POOLED for a in archs), mlm_head=any(a in _MLM for a in archs),
    )
    cfg.validate(prefix="bert config")
    return cfg


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors`` (one file or an index of shards), else ``pytorch_model.bin``
    read with ``weights_only=True`` (tensors only, no arbitrary pickled objects)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = hf_files.shard_names(index)
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out |= load_file(str(path / name))
        return out
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # a pickle that holds more than tensors, or a broken file
            raise CheckpointError(f"{path / 'pytorch_model.bin'} could not be read as tensors only: {e}") from None
    raise CheckpointError(f"{path} has no model.safetensors (or an index of shards) nor pytorch_model.bin: give a "
                          f"Hugging Face BERT model directory")


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[bert.Config, dict]:
    """(Config, params) from a local Hugging Face BERT directory (``config.json`` and the
    weights). The pooler and MLM head are loaded when their tensors are present."""
    path = Path(path)
    hf = hf_files.read_config(path, "give a Hugging Face BERT model directory")
    sd = _normalise_keys(_read_state_dict(path))
    cfg = dataclasses.replace(config_from_hf(hf), pooler="pooler.dense.weight" in sd,
                              mlm_head="cls.predictions.transform.dense.weight" in sd)
    return cfg, tree.map_leaves(lambda t: t.to(dtype), bert_from_hf(sd, cfg))
