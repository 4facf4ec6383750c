"""GPT-2, as published: learned position embeddings, pre-LayerNorm blocks, tanh-GELU MLP,
biases everywhere, and the output head tied to the token embedding.

Read top to bottom: ``Config`` → ``param_specs`` (what the parameters are) → ``forward``
(what they compute). Sharding is not here: only logical axis names, which the planner maps
onto a mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ZEROS, ParamSpec, normal
from fxmega.models.census import Saved
from fxmega.models.checks import require_heads_divide, require_positive
from fxmega.models.family import ModelFamily, keeps
from fxmega.ops import layers, objectives
from fxmega.sharding.layout import shard


@dataclass(frozen=True)
class Config:
    vocab_size: int = 50257
    max_seq_len: int = 1024  # number of learned positions
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 0  # 0 means 4 * d_model
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    def validate(self, prefix: str = "model") -> None:
        require_positive(self, ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"), prefix)
        if self.d_ff < 0:
            raise ConfigError(f"{prefix}.d_ff={self.d_ff} must be positive, or 0 for 4 * d_model")
        require_heads_divide(self.d_model, self.n_heads, prefix)


def param_specs(cfg: Config) -> dict:
    """The parameter tree, with a logical name on every dim."""
    d, h, hd, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim
    weight = normal(cfg.init_std)
    # GPT-2 scales the init of the projections that write into the residual stream by
    # 1/sqrt(2 * n_layers): each block adds two of them, and the sum should not grow with depth.
    residual = normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def norm() -> dict:
        return {"scale": ParamSpec((d,), ("embed",), ONES), "bias": ParamSpec((d,), ("embed",), ZEROS)}

    def block() -> dict:
        return {
            "attn_norm": norm(),
            "attn": {
                "wqkv": ParamSpec((d, 3, h, hd), ("embed", "qkv", "heads", "head_dim"), weight),
                "bqkv": ParamSpec((3, h, hd), ("qkv", "heads", "head_dim"), ZEROS),
                "wo": ParamSpec((h, hd, d), ("heads", "head_dim", "embed"), residual),
                "bo": ParamSpec((d,), ("embed",), ZEROS),
            },
            "mlp_norm": norm(),
            "mlp": {
                "w_in": ParamSpec((d, f), ("embed", "mlp"), weight),
                "b_in": ParamSpec((f,), ("mlp",), ZEROS),
                "w_out": ParamSpec((f, d), ("mlp", "embed"), residual),
                "b_out": ParamSpec((d,), ("embed",), ZEROS),
            },
        }

    return {
        "embed": {
            "tokens": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), weight),
            "positions": ParamSpec((cfg.max_seq_len, d), ("position", "embed"), weight),
        },
        "blocks": [block() for _ in range(cfg.n_layers)],
        "final_norm": norm(),
    }


# Top-level parameter groups read by ``embed`` and by ``head`` (the head is tied to the
# token embedding).
EMBED_PARAMS = ("embed",)
HEAD_PARAMS = ("final_norm", "embed")
# What the embedding reads from a batch besides the tokens (a pipeline's first stage gets
# them stacked with the tokens): each token's position, when the batch has them (context
# parallelism's head-tail chunks are out of order); else 0, 1, 2, ...
EMBED_INPUTS: tuple[str, ...] = ("positions",)
CONTEXT_PARALLEL = True  # attend_inputs takes positions, so a sequence may be split into out-of-order chunks
# What one block keeps for its backward (``fxmega.models.census``): two LayerNorms, the fused
# QKV projection, the tanh-GELU MLP.
BLOCK_SAVED = (
    Saved("input", 1, "embed", "act", True, "input"),
    Saved("attn_norm.stats", 2, "one", "fp32", True, "other"),
    Saved("attn_norm.output", 1, "embed", "act", False, "norm_out"),
    Saved("attn.qkv", 3, "q", "act", False, "matmul"),
    Saved("attn.out", 1, "q", "act", False, "attention"),
    Saved("attn.lse", 1, "heads", "fp32", False, "attention"),
    Saved("attn.wo_out", 1, "embed", "act", False, "projection_out"),
    Saved("residual", 1, "embed", "act", True, "other"),
    Saved("mlp_norm.stats", 2, "one", "fp32", True, "other"),
    Saved("mlp_norm.output", 1, "embed", "act", False, "norm_out"),
    Saved("mlp.pre_gelu", 1, "mlp", "act", False, "matmul"),
    Saved("mlp.gelu", 1, "mlp", "act", False, "other"),
    Saved("mlp.out", 1, "embed", "act", False, "projection_out"),
)


def objective(cfg: Config) -> objectives.Objective:
    """What this family trains for: next-token cross-entropy over the vocabulary."""
    return objectives.causal_lm(cfg.vocab_size)


def attend_inputs(cfg: Config, seq_len: int, device: torch.device, valid: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> layers.Attend:
    """What every block's attention reads, built once per step: the mask of a padded batch
    (``valid``) or of out-of-order chunks (``positions``); learned positions need no tables."""
    return layers.attend_inputs(seq_len, device, valid=valid, positions=positions)


def attention(p: dict, x: torch.Tensor, attend: layers.Attend = layers.IN_ORDER, cache: layers.KV | None = None,
              write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """Causal self-attention; with ``cache`` and ``write`` (decoding, see ``fxmega.models.pieces.decode_pieces``)
    it attends over the cache instead and also returns the updated cache."""
    qkv = layers.project_to_heads(x, p["wqkv"], p["bqkv"])  # [batch, seq, 3, heads, head_dim]
    q, k, v = qkv.unbind(dim=2)
    if cache is not None:
        out, cache = layers.cached_attention(q, k, v, cache, write)
        return layers.project_from_heads(out, p["wo"], p["bo"]), cache
    out = layers.causal_attention(q, k, v, attend)
    return layers.project_from_heads(out, p["wo"], p["bo"])


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = layers.gelu_tanh(layers.linear(x, p["w_in"], p["b_in"]))
    h = shard(h, "batch", "ctx", "mlp")
    return layers.linear(h, p["w_out"], p["b_out"])


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None,
          attend: layers.Attend | None = None, cache: layers.KV | None = None,
          write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """One pre-LN block on the residual stream ``x [batch, seq, embed]`` (``valid``: the
    padding mask, see ``layers.causal_attention``). With ``cache`` and ``write`` it decodes
    (see ``fxmega.models.pieces.decode_pieces``) and returns ``(x, updated cache)``.

    Each sublayer reads the block's sequence (``ctx``: whole, or a context-parallel rank's
    chunks) and its output is brought back to the residual stream's layout: with sequence
    parallelism that is Megatron's all-gather before and reduce-scatter after each sublayer.
    ``attend`` is the step's (``attend_inputs``, built once for every block); without it
    the block builds its own from ``valid``.
    """
    if attend is None and cache is None:
        attend = attend_inputs(cfg, x.shape[1], x.device, valid)
    h = shard(layers.layer_norm(x, **p["attn_norm"], eps=cfg.norm_eps), "batch", "ctx", "embed")
    if cache is not None:
        a, cache = attention(p["attn"], h, cache=cache, write=write)
    else:
        a = attention(p["attn"], h, attend)
    x = x + shard(a, "batch", "seq", "embed")
    h = shard(layers.layer_norm(x, **p["mlp_norm"], eps=cfg.norm_eps), "batch", "ctx", "embed")
    x = x + shard(mlp(p["mlp"], h), "batch", "seq", "embed")
    return x if cache is None else (x, cache)


def embed(params: dict, tokens: torch.Tensor, cfg: Config, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Token plus position embeddings: the residual stream's start. ``positions [batch, seq]``
    (decoding) picks each token's position; by default they are 0, 1, 2, ..."""
    x = shard(torch.nn.functional.embedding(tokens, params["embed"]["tokens"]), "batch", "seq", "embed")
    if positions is not None:  # plain indices: under a sharding plan ``shard`` makes them a DTensor like the table
        return x + torch.nn.functional.embedding(shard(positions, "batch", "seq"), params["embed"]["positions"])
    return x + shard(params["embed"]["positions"][: tokens.shape[1]], "seq", "embed")


def final_hidden(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The final LayerNorm: what the output projection reads."""
    return shard(layers.layer_norm(x, **params["final_norm"], eps=cfg.norm_eps), "batch", "ctx", "embed")


def output_weight(params: dict) -> torch.Tensor:
    """The output projection ``[embed, vocab]``: the token embedding, tied."""
    return params["embed"]["tokens"].t()


# What a sequence-classification head pools from (``fxmega.models.classifier``): each row's
# last real token through the final norm (causal attention: the only position that has seen
# the whole text).
POOL_PARAMS = ("final_norm",)


def pool(params: dict, x: torch.Tensor, valid: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """One ``[batch, embed]`` vector per row of the final hidden states ``x``: the last
    position ``valid`` (the attention mask) marks, after the final norm."""
    # the final norm is per token: normalising only the gathered rows gives the same vectors
    return final_hidden(params, layers.last_real_token(x, valid), cfg)[:, 0]


def head(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Final LayerNorm and the tied output projection onto the vocabulary."""
    logits = layers.linear(final_hidden(params, x, cfg), output_weight(params), role="head")
    return shard(logits, "batch", "ctx", "vocab")


def forward(params: dict, tokens: torch.Tensor, cfg: Config,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` for ``tokens [batch, seq]``; ``attention_mask
    [batch, seq]`` (1 for tokens, 0 for padding) for padded batches."""
    x = embed(params, tokens, cfg)
    attend = attend_inputs(cfg, tokens.shape[1], tokens.device, attention_mask)
    for p in params["blocks"]:
        x = block(p, x, cfg, attention_mask, attend)
    return head(params, x, cfg)


def kv_cache_shape(cfg: Config, batch: int, max_len: int) -> tuple[int, ...]:
    """The shape of one block's cached keys (and values): ``[batch, max_len, heads, head_dim]``."""
    return (batch, max_len, cfg.n_heads, cfg.head_dim)


def decode_write(cfg: Config, start: int, new: int, max_len: int, pad: torch.Tensor) -> layers.CacheWrite:
    """Where ``new`` tokens go in the cache and what they attend to (``layers.cache_write``);
    positions are learned, so no rotary tables."""
    return layers.cache_write(start, new, max_len, pad)


FAMILY = ModelFamily(
    name="gpt", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head, objective=objective,
    EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS, attend_inputs=attend_inputs,
    CONTEXT_PARALLEL=CONTEXT_PARALLEL, block_saved=keeps(BLOCK_SAVED), final_hidden=final_hidden,
    output_weight=output_weight, POOL_PARAMS=POOL_PARAMS, pool=pool, kv_cache_shape=kv_cache_shape,
    decode_write=decode_write,
)
