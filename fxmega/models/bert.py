"""BERT, as published (Devlin et al.; Hugging Face ``BertModel``): word, position and
token-type embeddings with a LayerNorm, post-LayerNorm encoder blocks with bidirectional
attention, exact (erf) GELU, biases everywhere; optionally the pooler (dense + tanh on the
first token) and the masked-LM head (dense + GELU + LayerNorm, then the decoder tied to the
word embeddings plus a bias of its own).

Same shape as ``gpt.py``: ``Config`` → ``param_specs`` → ``forward``. ``forward`` returns
the final hidden states, not logits: BERT is an encoder, and what reads those states (the
MLM head, the pooler, a task head) depends on the use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ZEROS, ParamSpec, normal
from fxmega.models import gpt
from fxmega.models.checks import require_heads_divide, require_positive
from fxmega.models.family import ModelFamily, keeps
from fxmega.ops import layers, objectives
from fxmega.sharding.layout import local, shard


@dataclass(frozen=True)
class Config:
    vocab_size: int = 30522
    max_seq_len: int = 512  # number of learned positions (Hugging Face's max_position_embeddings)
    type_vocab_size: int = 2  # segments: sentence A / sentence B
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    norm_eps: float = 1e-12
    init_std: float = 0.02
    pooler: bool = True  # BertModel's pooler.dense (BertForMaskedLM has none)
    mlm_head: bool = True  # BertForMaskedLM's cls.predictions (BertModel has none)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, prefix: str = "model") -> None:
        require_positive(self, ("vocab_size", "max_seq_len", "type_vocab_size", "d_model", "n_layers", "n_heads",
                                "d_ff"), prefix)
        if self.norm_eps <= 0:
            raise ConfigError(f"{prefix}.norm_eps={self.norm_eps} must be positive (BERT uses 1e-12)")
        if self.init_std < 0:
            raise ConfigError(f"{prefix}.init_std={self.init_std} must be >= 0 (BERT uses 0.02)")
        require_heads_divide(self.d_model, self.n_heads, prefix)


def param_specs(cfg: Config) -> dict:
    """The parameter tree, with a logical name on every dim.

    ``token_type`` and ``embed_out`` are names only BERT has; rules that do not mention
    them leave those dims whole (replicated). ``embed_out`` is the output dim of the square
    ``[embed, embed]`` pooler and MLM-transform weights: a second ``embed`` would let an
    FSDP rule split both dims of one weight, which the planner refuses.
    """
    d, h, hd, f = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    # BERT draws every weight from one normal (no depth-scaled residual init, unlike GPT-2)
    weight = normal(cfg.init_std)

    def norm() -> dict:
        return {"scale": ParamSpec((d,), ("embed",), ONES), "bias": ParamSpec((d,), ("embed",), ZEROS)}

    def dense() -> dict:
        return {"w": ParamSpec((d, d), ("embed", "embed_out"), weight), "b": ParamSpec((d,), ("embed",), ZEROS)}

    def block() -> dict:
        attn = {}
        for name in ("q", "k", "v"):
            attn[f"w{name}"] = ParamSpec((d, h, hd), ("embed", "heads", "head_dim"), weight)
            attn[f"b{name}"] = ParamSpec((h, hd), ("heads", "head_dim"), ZEROS)
        attn["wo"] = ParamSpec((h, hd, d), ("heads", "head_dim", "embed"), weight)
        attn["bo"] = ParamSpec((d,), ("embed",), ZEROS)
        return {
            "attn": attn,
            "attn_norm": norm(),
            "mlp": {
                "w_in": ParamSpec((d, f), ("embed", "mlp"), weight),
                "b_in": ParamSpec((f,), ("mlp",), ZEROS),
                "w_out": ParamSpec((f, d), ("mlp", "embed"), weight),
                "b_out": ParamSpec((d,), ("embed",), ZEROS),
            },
            "mlp_norm": norm(),
        }

    out: dict = {
        "embed": {
            "tokens": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), weight),
            "positions": ParamSpec((cfg.max_seq_len, d), ("position", "embed"), weight),
            "token_types": ParamSpec((cfg.type_vocab_size, d), ("token_type", "embed"), weight),
            "norm": norm(),
        },
        "blocks": [block() for _ in range(cfg.n_layers)],
    }
    if cfg.pooler:
        out["pooler"] = dense()
    if cfg.mlm_head:
        out["mlm"] = {**dense(), "norm": norm(), "b_vocab": ParamSpec((cfg.vocab_size,), ("vocab",), ZEROS)}
    return out


# Top-level parameter groups read by ``embed`` and by ``head`` (the MLM decoder is tied to
# the word embedding).
EMBED_PARAMS = ("embed",)
HEAD_PARAMS = ("mlm", "embed")
# What ``embed`` reads from a batch besides the tokens, in its argument order.
EMBED_INPUTS: tuple[str, ...] = ("token_types",)
# The embedding ends with a LayerNorm, whose backward reads its scale (ZeRO-3 gathers the
# embedding again for the backward; the estimates count it).
EMBED_BACKWARD_READS_PARAMS = True
# What one block keeps for its backward: the tensors of a GPT block (two LayerNorms, fused
# QKV, a GELU MLP); post-LN orders them differently but keeps the same sizes.
BLOCK_SAVED = gpt.BLOCK_SAVED


def objective(cfg: Config) -> objectives.Objective:
    """Pre-training: masked-token cross-entropy over the positions ``loss_mask`` marks."""
    return objectives.masked_lm(cfg.vocab_size)

# Inside attention the sequence is whole (None): batch and heads may be split.
_QKV_AXES = ("batch", None, "heads", "head_dim")


def key_mask(valid: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, 1, seq]`` boolean mask (True: may attend) from ``valid [batch, seq]``:
    every query sees every non-padding key. A row with no valid key at all attends to all
    keys instead (an all-False row would make SDPA's softmax NaN); Hugging Face's additive
    mask gives the same uniform weights there."""
    keep = valid.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def _bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             valid: torch.Tensor | None = None) -> torch.Tensor:
    # Runs on local shards: batch and heads may be split, seq and head_dim are whole.
    mask = None if valid is None else key_mask(valid)
    return layers.sdpa(q, k, v, attn_mask=mask)


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            valid: torch.Tensor | None = None) -> torch.Tensor:
    """Self-attention with no causal mask, through SDPA. ``q``, ``k``, ``v`` are
    ``[batch, seq, heads, head_dim]``; ``valid [batch, seq]`` (1 for tokens, 0 for padding)
    keeps padding keys out."""
    if valid is None:
        return local(_bidirectional_attention, (_QKV_AXES, _QKV_AXES, _QKV_AXES), _QKV_AXES)(q, k, v)
    fn = local(_bidirectional_attention, (_QKV_AXES, _QKV_AXES, _QKV_AXES, ("batch", None)), _QKV_AXES)
    return fn(q, k, v, valid)


def attention(p: dict, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    q = layers.project_to_heads(x, p["wq"], p["bq"])
    k = layers.project_to_heads(x, p["wk"], p["bk"])
    v = layers.project_to_heads(x, p["wv"], p["bv"])
    return layers.project_from_heads(bidirectional_attention(q, k, v, valid), p["wo"], p["bo"])


def gelu(x: torch.Tensor) -> torch.Tensor:
    """BERT's GELU: the exact erf form (Hugging Face's ``"gelu"``), not GPT-2's tanh one."""
    return F.gelu(x)


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = shard(gelu(layers.linear(x, p["w_in"], p["b_in"])), "batch", "ctx", "mlp")
    return layers.linear(h, p["w_out"], p["b_out"])


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None) -> torch.Tensor:
    """One post-LN block on the residual stream ``x [batch, seq, embed]``: each sublayer's
    output is added to its input and the sum normalised (``LN(x + f(x))``), so that the
    stream between blocks is always normalised. Sublayers read the whole sequence and
    their outputs come back to the stream's layout as in ``gpt.block``; the LayerNorms are
    per token, so they run on the stream's layout (split along seq under sequence
    parallelism)."""
    h = shard(x, "batch", "ctx", "embed")
    x = x + shard(attention(p["attn"], h, valid), "batch", "seq", "embed")
    x = layers.layer_norm(x, **p["attn_norm"], eps=cfg.norm_eps)
    h = shard(x, "batch", "ctx", "embed")
    x = x + shard(mlp(p["mlp"], h), "batch", "seq", "embed")
    return layers.layer_norm(x, **p["mlp_norm"], eps=cfg.norm_eps)


def embed(params: dict, tokens: torch.Tensor, cfg: Config, token_types: torch.Tensor | None = None) -> torch.Tensor:
    """Word + token-type + position embeddings, then LayerNorm: the residual stream's start.
    ``token_types`` (Hugging Face's ``token_type_ids``) default to all zeros (segment A)."""
    p = params["embed"]
    if token_types is None:
        token_types = torch.zeros_like(tokens)
    x = shard(F.embedding(tokens, p["tokens"]), "batch", "seq", "embed")
    x = x + shard(F.embedding(token_types, p["token_types"]), "batch", "seq", "embed")
    x = x + shard(p["positions"][: tokens.shape[1]], "seq", "embed")
    return layers.layer_norm(x, **p["norm"], eps=cfg.norm_eps)


def forward(params: dict, tokens: torch.Tensor, cfg: Config, token_types: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states ``[batch, seq, embed]`` for ``tokens [batch, seq]``;
    ``token_types [batch, seq]`` (segment ids) and ``attention_mask [batch, seq]`` (1 for
    tokens, 0 for padding) as Hugging Face's ``token_type_ids`` and ``attention_mask``."""
    x = embed(params, tokens, cfg, token_types)
    for p in params["blocks"]:
        x = block(p, x, cfg, attention_mask)
    return x


def mlm_logits(params: dict, hidden: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The masked-LM head: ``[batch, seq, embed] -> [batch, seq, vocab]`` (dense, GELU,
    LayerNorm, then the word embedding, tied, plus the decoder's own bias)."""
    m = params["mlm"]
    h = layers.layer_norm(gelu(layers.linear(hidden, m["w"], m["b"])), **m["norm"], eps=cfg.norm_eps)
    h = shard(h, "batch", "ctx", "embed")
    logits = layers.linear(h, params["embed"]["tokens"].t(), m["b_vocab"], role="head")
    return shard(logits, "batch", "ctx", "vocab")


head = mlm_logits  # the piece that ``models.forward_by_pieces`` calls with HEAD_PARAMS


def pooler_output(params: dict, hidden: torch.Tensor, cfg: Config) -> torch.Tensor:
    """BERT's pooler: dense + tanh on the first ([CLS]) token, ``[batch, embed]``."""
    p = params["pooler"]
    return torch.tanh(layers.linear(hidden[:, 0], p["w"], p["b"]))


# What a sequence-classification head pools from (``fxmega.models.classifier``): the pooler
# where the config has one, else the [CLS] hidden state.
POOL_PARAMS = ("pooler",)


def pool(params: dict, x: torch.Tensor, valid: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """One ``[batch, embed]`` vector per row: the pooler's output, or the [CLS] hidden state."""
    return pooler_output(params, x, cfg) if cfg.pooler else x[:, 0]


FAMILY = ModelFamily(
    name="bert", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head, objective=objective,
    EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS,
    EMBED_BACKWARD_READS_PARAMS=EMBED_BACKWARD_READS_PARAMS, block_saved=keeps(BLOCK_SAVED),
    POOL_PARAMS=POOL_PARAMS, pool=pool,
)
