"""Llama (2 and 3), as published: RMSNorm, rotary position embeddings (rotate-half layout;
Llama 3.1's and YaRN's long-context scaling, ``fxmega.ops.rope``), SwiGLU MLP, grouped-query
attention, no biases, and an untied output head.

Same shape as ``gpt.py``: ``Config`` → ``param_specs`` → ``forward``; sharding lives
elsewhere and sees only the logical axis names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ZEROS, Init, ParamSpec, normal
from fxmega.models.census import Saved
from fxmega.models.checks import require_positive
from fxmega.models.family import ModelFamily, keeps
from fxmega.ops import layers, objectives
from fxmega.ops.rope import Rope, RopeScaling
from fxmega.sharding.layout import shard


@dataclass(frozen=True)
class Config:
    vocab_size: int = 32000
    max_seq_len: int = 4096  # longest sequence trained on; rotary positions need no table
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 0  # 0 means n_heads (no grouping)
    d_ff: int = 11008
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # long context: llama3 or yarn
    norm_eps: float = 1e-5
    init_std: float = 0.02
    d_head: int = 0  # each head's width (0: d_model / n_heads; Qwen3 sets it apart, e.g. 128 at d_model 2048, 32 heads)
    qk_norm: bool = False  # RMSNorm over each head's query and key before the rotation (Qwen3, OLMo 2)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2, Qwen2-MoE)

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def rope(self) -> Rope:
        return Rope(self.rope_theta, self.rope_scaling)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def validate(self, prefix: str = "model") -> None:
        require_positive(self, ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff"), prefix)
        self.rope_scaling.validate(f"{prefix}.rope_scaling")
        if self.n_kv_heads < 0:
            raise ConfigError(f"{prefix}.n_kv_heads={self.n_kv_heads} must be positive, or 0 for n_heads")
        if self.d_head < 0:
            raise ConfigError(f"{prefix}.d_head={self.d_head} must be positive, or 0 for d_model / n_heads")
        if not self.d_head and self.d_model % self.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads={self.n_heads} does not divide {prefix}.d_model={self.d_model}: "
                f"choose n_heads so that d_model / n_heads is a whole head size"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head size {self.head_dim} (d_model/n_heads) is odd: rotary embeddings rotate "
                f"pairs of dims, choose {prefix}.n_heads so the head size is even"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads={self.n_kv_heads} does not divide {prefix}.n_heads={self.n_heads}: "
                f"each group of query heads shares one key/value head"
            )


def inits(cfg: Config) -> tuple[Init, Init]:
    """The projections' initialisers: ``weight``, and ``residual`` for those that write into
    the residual stream, which start smaller, as in GPT-2 and Megatron's scaled init, so the
    residual does not grow with depth."""
    return normal(cfg.init_std), normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))


def block_specs(cfg: Config, feed_forward: dict) -> dict:
    """One block's parameters: the norms and attention, and ``feed_forward`` (its sublayer's
    parameter groups: ``{"mlp": ...}`` here, ``{"moe": ...}`` for experts)."""
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    weight, residual = inits(cfg)
    return {
        "attn_norm": {"scale": ParamSpec((d,), ("embed",), ONES)},
        "attn": {
            "wq": ParamSpec((d, h, hd), ("embed", "heads", "head_dim"), weight),
            "wk": ParamSpec((d, kv, hd), ("embed", "kv_heads", "head_dim"), weight),
            "wv": ParamSpec((d, kv, hd), ("embed", "kv_heads", "head_dim"), weight),
            "wo": ParamSpec((h, hd, d), ("heads", "head_dim", "embed"), residual),
            **({"q_norm": {"scale": ParamSpec((hd,), ("head_dim",), ONES)},
                "k_norm": {"scale": ParamSpec((hd,), ("head_dim",), ONES)}} if cfg.qk_norm else {}),
            **({"bq": ParamSpec((h, hd), ("heads", "head_dim"), ZEROS),
                "bk": ParamSpec((kv, hd), ("kv_heads", "head_dim"), ZEROS),
                "bv": ParamSpec((kv, hd), ("kv_heads", "head_dim"), ZEROS)} if cfg.qkv_bias else {}),
        },
        "mlp_norm": {"scale": ParamSpec((d,), ("embed",), ONES)},
        **feed_forward,
    }


def mlp_specs(cfg: Config, d_ff: int) -> dict:
    """The SwiGLU MLP's parameters, width ``d_ff``."""
    d = cfg.d_model
    weight, residual = inits(cfg)
    return {"mlp": {
        "w_gate": ParamSpec((d, d_ff), ("embed", "mlp"), weight),
        "w_up": ParamSpec((d, d_ff), ("embed", "mlp"), weight),
        "w_down": ParamSpec((d_ff, d), ("mlp", "embed"), residual),
    }}


def specs_with_blocks(cfg: Config, blocks: list[dict]) -> dict:
    """The whole model's parameters around ``blocks``: embedding, final norm, untied head."""
    weight, _ = inits(cfg)
    return {
        "embed": {"tokens": ParamSpec((cfg.vocab_size, cfg.d_model), ("vocab", "embed"), weight)},
        "blocks": blocks,
        "final_norm": {"scale": ParamSpec((cfg.d_model,), ("embed",), ONES)},
        "head": ParamSpec((cfg.d_model, cfg.vocab_size), ("embed", "vocab"), weight),
    }


def param_specs(cfg: Config) -> dict:
    return specs_with_blocks(cfg, [block_specs(cfg, mlp_specs(cfg, cfg.d_ff)) for _ in range(cfg.n_layers)])


# Top-level parameter groups read by ``embed`` and by ``head``.
EMBED_PARAMS = ("embed",)
HEAD_PARAMS = ("final_norm", "head")
# What the embedding reads from a batch besides the tokens (a pipeline's first stage gets
# them stacked with the tokens): nothing.
EMBED_INPUTS: tuple[str, ...] = ()
CONTEXT_PARALLEL = True  # attend_inputs takes positions, so a sequence may be split into out-of-order chunks
# What one block keeps for its backward (``fxmega.models.census``). RMSNorm runs in fp32: its
# fp32 input, the rsqrt statistics and the normalised values; a recomputed region keeps the
# residual in the compute dtype instead of the fp32 copy.
NORMS_SAVED = (  # the block's input and its two norms
    Saved("input", 1, "embed", "act", True, "region_input"),
    Saved("attn_norm.input_fp32", 1, "embed", "fp32", True, "autograd_input"),
    Saved("attn_norm.rstd", 1, "one", "fp32", True, "other"),
    Saved("attn_norm.normed", 1, "embed", "act", True, "other"),
    Saved("attn_norm.output", 1, "embed", "act", False, "norm_out"),
    Saved("mlp_norm.input_fp32", 1, "embed", "fp32", True, "other"),
    Saved("mlp_norm.rstd", 1, "one", "fp32", True, "other"),
    Saved("mlp_norm.normed", 1, "embed", "act", True, "other"),
    Saved("mlp_norm.output", 1, "embed", "act", False, "norm_out"),
)
SAVED_BESIDE_MLP = NORMS_SAVED + (  # the norms and the attention
    Saved("attn.q", 1, "q", "act", False, "matmul"),
    Saved("attn.k", 1, "kv", "act", False, "matmul"),
    Saved("attn.v", 1, "kv", "act", False, "matmul"),
    Saved("attn.out", 1, "q", "act", False, "attention"),
    Saved("attn.lse", 1, "heads", "fp32", False, "attention"),
    Saved("attn.wo_out", 1, "embed", "act", False, "projection_out"),
)


def mlp_saved(name: str = "mlp", width: str = "mlp") -> tuple[Saved, ...]:
    """What a SwiGLU MLP of hidden ``width`` keeps (a MoE layer's shared experts are one)."""
    return (
        Saved(f"{name}.gate", 1, width, "act", False, "matmul"),
        Saved(f"{name}.up", 1, width, "act", False, "matmul"),
        Saved(f"{name}.silu", 1, width, "act", False, "other"),
        Saved(f"{name}.hidden", 1, width, "act", False, "other"),
        Saved(f"{name}.down_out", 1, "embed", "act", False, "projection_out"),
    )


BLOCK_SAVED = SAVED_BESIDE_MLP + mlp_saved()


def objective(cfg: Config) -> objectives.Objective:
    """What this family trains for: next-token cross-entropy over the vocabulary."""
    return objectives.causal_lm(cfg.vocab_size)


def attend_inputs(cfg: Config, seq_len: int, device: torch.device, valid: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> layers.Attend:
    """What every block's attention reads, built once per step: the rotary tables (at
    ``positions`` when the tokens are out-of-order chunks) and the mask padding or chunks need."""
    return layers.attend_inputs(seq_len, device, cfg.rope, cfg.head_dim, valid, positions)


def attention(p: dict, x: torch.Tensor, cfg: Config, attend: layers.Attend = layers.IN_ORDER,
              cache: layers.KV | None = None,
              write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """Causal self-attention with rotary positions (the tables in ``attend``); with ``cache`` and
    ``write`` (decoding, see ``fxmega.models.pieces.decode_pieces``) it attends over the cache
    instead and also returns the updated cache."""
    q = layers.project_to_heads(x, p["wq"], p.get("bq"))
    k = layers.project_to_heads(x, p["wk"], p.get("bk"))
    v = layers.project_to_heads(x, p["wv"], p.get("bv"))
    if "q_norm" in p:  # qk_norm: each head's query and key normalised over head_dim, then rotated
        q = layers.rms_norm(q, p["q_norm"]["scale"], cfg.norm_eps)
        k = layers.rms_norm(k, p["k_norm"]["scale"], cfg.norm_eps)
    if cache is not None:  # the rotary tables come with ``write``, at each row's positions
        out, cache = layers.cached_attention(q, k, v, cache, write)
        return layers.project_from_heads(out, p["wo"]), cache
    out = layers.causal_attention(q, k, v, attend)
    return layers.project_from_heads(out, p["wo"])


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""
    h = torch.nn.functional.silu(layers.linear(x, p["w_gate"])) * layers.linear(x, p["w_up"])
    h = shard(h, "batch", "ctx", "mlp")
    return layers.linear(h, p["w_down"])


FeedForward = Callable[[dict, torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]


def dense_feed_forward(p: dict, h: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The block's feed-forward sublayer: the SwiGLU MLP ``p["mlp"]``."""
    return mlp(p["mlp"], h)


def residual_block(p: dict, x: torch.Tensor, cfg: Config, feed_forward: FeedForward, valid: torch.Tensor | None = None,
                   attend: layers.Attend | None = None, cache: layers.KV | None = None,
                   write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """One pre-norm block on the residual stream ``x [batch, seq, embed]``: attention, then
    ``feed_forward(p, h, cfg, valid)`` (the MLP here; experts in ``fxmega.models.mixtral``).
    Sublayers read the whole sequence (see ``gpt.block``); ``valid`` is the padding mask.
    With ``cache`` and ``write`` it decodes (see ``fxmega.models.pieces.decode_pieces``) and
    returns ``(x, updated cache)``. ``attend`` is the step's (``attend_inputs``, built once for
    every block); without it the block builds its own from ``valid``."""
    if attend is None and cache is None:
        attend = attend_inputs(cfg, x.shape[1], x.device, valid)
    h = shard(layers.rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps), "batch", "ctx", "embed")
    if cache is not None:
        a, cache = attention(p["attn"], h, cfg, cache=cache, write=write)
    else:
        a = attention(p["attn"], h, cfg, attend)
    x = x + shard(a, "batch", "seq", "embed")
    h = shard(layers.rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps), "batch", "ctx", "embed")
    x = x + shard(feed_forward(p, h, cfg, valid), "batch", "seq", "embed")
    return x if cache is None else (x, cache)


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None,
          attend: layers.Attend | None = None, cache: layers.KV | None = None,
          write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """One Llama block (``residual_block`` with the dense MLP)."""
    return residual_block(p, x, cfg, dense_feed_forward, valid, attend, cache, write)


def embed(params: dict, tokens: torch.Tensor, cfg: Config, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The token embedding: the residual stream's start. Positions enter as rotations in
    attention, so ``positions`` (decoding) is not read here."""
    x = torch.nn.functional.embedding(tokens, params["embed"]["tokens"])
    return shard(x, "batch", "seq", "embed")


def final_hidden(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The final RMSNorm: what the output projection reads."""
    return shard(layers.rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps), "batch", "ctx", "embed")


def output_weight(params: dict) -> torch.Tensor:
    """The (untied) output projection ``[embed, vocab]``."""
    return params["head"]


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
    """Final RMSNorm and the output projection onto the vocabulary."""
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
    """The shape of one block's cached keys (and values): ``[batch, max_len, kv_heads, head_dim]``
    (grouped heads are cached once per group, not repeated per query head)."""
    return (batch, max_len, cfg.kv_heads, cfg.head_dim)


def decode_write(cfg: Config, start: int, new: int, max_len: int, pad: torch.Tensor) -> layers.CacheWrite:
    """Where ``new`` tokens go in the cache and what they attend to (``layers.cache_write``),
    with the rotary tables at each row's positions, built once for every layer."""
    return layers.cache_write(start, new, max_len, pad, cfg.head_dim, cfg.rope)


FAMILY = ModelFamily(
    name="llama", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head, objective=objective,
    EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS, attend_inputs=attend_inputs,
    CONTEXT_PARALLEL=CONTEXT_PARALLEL, block_saved=keeps(BLOCK_SAVED), final_hidden=final_hidden,
    output_weight=output_weight, POOL_PARAMS=POOL_PARAMS, pool=pool, kv_cache_shape=kv_cache_shape,
    decode_write=decode_write, kv_heads=lambda cfg: cfg.kv_heads,
)
