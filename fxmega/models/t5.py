"""T5, the encoder–decoder transformer (Raffel et al.; Hugging Face ``T5ForConditionalGeneration``):
a token embedding shared by both stacks, pre-norm blocks with T5's layer norm (RMS, no bias,
no mean), attention without the 1/sqrt(d) scale and with a learned relative position bias
(one table per stack, shared by all its layers; bidirectional buckets in the encoder, causal
in the decoder), a ReLU (original T5) or gated-GELU (T5 v1.1) feed-forward, and the output
projection tied to the embedding (scaled by d_model^-1/2) or untied (v1.1).

**One residual stream for two stacks.** The pieces every runtime knows — an embedding, a
list of blocks, a head — carry one tensor between them, so the stream here is the source and
the target side by side along the sequence: ``[batch, encoder_seq_len + decoder_len, embed]``
(Megatron likewise fixes ``--encoder-seq-length`` and ``--decoder-seq-length``). Encoder
blocks change the source part and carry the target part through; the first decoder block
puts the encoder's final norm on the source part (the memory every cross-attention reads);
decoder blocks change the target part; the head reads the target part. So data parallelism,
ZeRO, FSDP, tensor and sequence parallelism, recompute and the compiled step run T5 as they
run GPT. Pipeline parallelism is refused: the relative position tables are read by every
block, which a stage cut would have to share across stages (``check_mesh``).

``encode`` / ``decode`` run the same layers on separate source and target tensors, with a
KV cache for generation (the cross-attention keys and values computed once per source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ParamSpec, normal
from fxmega.models import gpt
from fxmega.models.checks import require_positive
from fxmega.models.family import ModelFamily, keeps
from fxmega.models.pieces import run_pieces
from fxmega.ops import layers, objectives, recompute
from fxmega.sharding.layout import local, shard
from fxmega.sharding.mesh import MeshSpec

FFN_KINDS = ("relu", "gated-gelu")


@dataclass(frozen=True)
class Config:
    vocab_size: int = 32128
    encoder_seq_len: int = 512  # source tokens per sample (Megatron's --encoder-seq-length)
    decoder_seq_len: int = 128  # target tokens per sample (--decoder-seq-length)
    d_model: int = 512
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_heads: int = 8
    d_kv: int = 64  # width of one head (T5 does not tie it to d_model / n_heads)
    d_ff: int = 2048
    ffn: str = "relu"  # "relu": T5; "gated-gelu": T5 v1.1, flan-t5
    tie_embeddings: bool = True  # T5: the head is the embedding (outputs scaled by d_model^-1/2); v1.1: untied
    relative_buckets: int = 32
    relative_max_distance: int = 128
    norm_eps: float = 1e-6
    init_std: float = 1.0  # Hugging Face's initializer_factor: each weight's std is this times its fan-in^-1/2
    pad_id: int = 0  # also the decoder's start token, as in T5
    eos_id: int = 1
    n_sentinels: int = 100  # span-corruption sentinels <extra_id_0>, <extra_id_1>, ... (0: none) counting down from
    sentinel_start: int = -1  # the id of <extra_id_0>; -1: the vocabulary's last id

    @property
    def max_seq_len(self) -> int:
        """The residual stream's length: source and target side by side."""
        return self.encoder_seq_len + self.decoder_seq_len

    @property
    def n_layers(self) -> int:
        """The number of blocks: encoder's, then decoder's."""
        return self.n_encoder_layers + self.n_decoder_layers

    @property
    def head_dim(self) -> int:
        return self.d_kv

    @property
    def first_sentinel(self) -> int:
        return self.vocab_size - 1 if self.sentinel_start < 0 else self.sentinel_start

    def sentinel(self, k: int) -> int:
        """The id of ``<extra_id_k>``."""
        return self.first_sentinel - k

    def validate(self, prefix: str = "model") -> None:
        require_positive(self, ("vocab_size", "encoder_seq_len", "decoder_seq_len", "d_model", "n_encoder_layers",
                                "n_decoder_layers", "n_heads", "d_kv", "d_ff", "relative_buckets",
                                "relative_max_distance"), prefix)
        if self.ffn not in FFN_KINDS:
            raise ConfigError(f"{prefix}.ffn={self.ffn!r}: use one of {', '.join(FFN_KINDS)}")
        if self.relative_buckets % 4:
            raise ConfigError(f"{prefix}.relative_buckets={self.relative_buckets} must be a multiple of 4 (half per "
                              f"direction, half of those exact): T5 uses 32")
        if self.norm_eps <= 0:
            raise ConfigError(f"{prefix}.norm_eps={self.norm_eps} must be positive (T5 uses 1e-6)")
        if self.init_std < 0:
            raise ConfigError(f"{prefix}.init_std={self.init_std} must be >= 0 (T5 uses 1.0)")
        if self.n_sentinels < 0:
            raise ConfigError(f"{prefix}.n_sentinels={self.n_sentinels} must be >= 0 (0: no span-corruption data)")
        specials = {"pad_id": self.pad_id, "eos_id": self.eos_id}
        if self.n_sentinels:
            specials |= {"sentinel_start": self.first_sentinel,
                         "n_sentinels": self.sentinel(self.n_sentinels - 1)}  # the last sentinel's id
        for name, i in specials.items():
            if not 0 <= i < self.vocab_size:
                raise ConfigError(f"{prefix}.{name}: id {i} is outside the vocabulary [0, {self.vocab_size}): "
                                  f"raise vocab_size or move the special ids")


def param_specs(cfg: Config) -> dict:
    """The parameter tree, with a logical name on every dim. Blocks 0 .. n_encoder_layers-1
    are the encoder's, the rest the decoder's (with cross-attention); the first decoder block
    also holds the encoder's final norm (see the module docstring). Initialised as Hugging
    Face's T5 is: every weight normal with std ``init_std`` x its fan-in^-1/2."""
    d, h, kv, f, k = cfg.d_model, cfg.n_heads, cfg.d_kv, cfg.d_ff, cfg.init_std

    def norm() -> dict:
        return {"scale": ParamSpec((d,), ("embed",), ONES)}

    def attention() -> dict:
        return {"wq": ParamSpec((d, h, kv), ("embed", "heads", "head_dim"), normal(k * (d * kv) ** -0.5)),
                "wk": ParamSpec((d, h, kv), ("embed", "heads", "head_dim"), normal(k * d ** -0.5)),
                "wv": ParamSpec((d, h, kv), ("embed", "heads", "head_dim"), normal(k * d ** -0.5)),
                "wo": ParamSpec((h, kv, d), ("heads", "head_dim", "embed"), normal(k * (h * kv) ** -0.5))}

    def feed_forward() -> dict:
        out = {"w_in": ParamSpec((d, f), ("embed", "mlp"), normal(k * d ** -0.5)),
               "w_out": ParamSpec((f, d), ("mlp", "embed"), normal(k * f ** -0.5))}
        if cfg.ffn.startswith("gated"):
            out["w_gate"] = ParamSpec((d, f), ("embed", "mlp"), normal(k * d ** -0.5))
        return out

    def block(decoder: bool, first: bool) -> dict:
        out: dict = {"attn_norm": norm(), "attn": attention()}
        if decoder:
            out |= {"cross_norm": norm(), "cross": attention()}
            if first:
                out["encoder_norm"] = norm()
        return out | {"mlp_norm": norm(), "mlp": feed_forward()}

    table = ParamSpec((cfg.relative_buckets, h), ("relative_bucket", "heads"), normal(k * d ** -0.5))
    head: dict = {"norm": norm()}
    if not cfg.tie_embeddings:
        head["w"] = ParamSpec((d, cfg.vocab_size), ("embed", "vocab"), normal(k))
    return {
        "embed": {"tokens": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), normal(k))},
        "relative": {"encoder": table, "decoder": table},
        "blocks": [block(False, False) for _ in range(cfg.n_encoder_layers)]
        + [block(True, i == 0) for i in range(cfg.n_decoder_layers)],
        "head": head,
    }


# Top-level parameter groups read by ``embed``, by ``head`` (the embedding too: tied, or
# read and unused when untied) and, besides its own, by every block (the relative tables).
EMBED_PARAMS = ("embed",)
HEAD_PARAMS = ("head", "embed")
BLOCK_SHARED_PARAMS = ("relative",)
# What ``embed`` reads from a batch besides the source tokens: the decoder's input tokens
# (the targets shifted right behind the start token).
EMBED_INPUTS: tuple[str, ...] = ("decoder_inputs",)
# What one block keeps for its backward, approximately: a GPT block's tensors (a decoder
# block keeps a cross-attention's more; the memory estimates count the encoder's size).
BLOCK_SAVED = gpt.BLOCK_SAVED


def objective(cfg: Config) -> objectives.Objective:
    """Pre-training by span corruption: cross-entropy of the target side (sentinels and the
    dropped spans) over the positions ``loss_mask`` marks (``fxmega.data.span_corruption``)."""
    return objectives.CrossEntropy("span-corruption", cfg.vocab_size)


def check_mesh(cfg: Config, mesh: MeshSpec) -> None:
    """What T5 does not run on, refused before anything is built."""
    for axis, why in (("pp", "every block reads the relative position tables, which pipeline stages would have to "
                             "share (and the encoder's output must reach every decoder stage)"),
                      ("cp", "the source and target sides attend across each other, not as one causal sequence")):
        if mesh.size(axis) > 1:
            raise ConfigError(f"--mesh {mesh.describe()}: the t5 family does not split over {axis}: {why}; use "
                              f"dp, fsdp, ZeRO and tp (with sequence parallelism)")


# ---------------------------------------------------------------------------------------
# relative positions, masks and attention


def relative_buckets(query: torch.Tensor, key: torch.Tensor, bidirectional: bool, n_buckets: int,
                     max_distance: int) -> torch.Tensor:
    """T5's bucket of each (query, key) position pair, ``[queries, keys]``: half the buckets
    exact offsets, half logarithmically wider up to ``max_distance``; bidirectional buckets
    split the count between keys after and before the query, causal ones see only before."""
    rel = key[None, :] - query[:, None]
    out = torch.zeros_like(rel)
    if bidirectional:
        n_buckets //= 2
        out = out + (rel > 0).long() * n_buckets
        rel = rel.abs()
    else:
        rel = -rel.clamp(max=0)
    exact = n_buckets // 2
    # float32 as T5's reference: the bucket boundaries are what the trained tables expect
    wide = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (n_buckets - exact)).long()
    wide = wide.clamp(max=n_buckets - 1)
    return out + torch.where(rel < exact, rel, wide)


class T5Attend(NamedTuple):
    """What every block reads that no layer changes, built once per step (``attend_inputs``)."""

    split: int  # where the source ends in the stream
    encoder_buckets: torch.Tensor  # [src, src]
    decoder_buckets: torch.Tensor  # [tgt, tgt]
    source_keys: torch.Tensor | None  # [batch, 1, 1, src] True for real source tokens; None: no padding


_QKV_AXES = ("batch", None, "heads", "head_dim")
_TABLE_AXES = (None, "heads")
_BUCKET_AXES = (None, None)
_KEYS_AXES = ("batch", None, None, None)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None,
            buckets: torch.Tensor | None, keys: torch.Tensor | None, causal: bool) -> torch.Tensor:
    # on local shards: batch and heads may be split, the sequence is whole. The bias and the
    # mask are added to the scores as T5 does (masked: the dtype's lowest value, so that a row
    # with no key left is uniform rather than NaN); no 1/sqrt(d) scale.
    tq, tk = q.shape[1], k.shape[1]
    bias = torch.zeros(1, 1, tq, tk, dtype=q.dtype, device=q.device)
    if table is not None:
        bias = F.embedding(buckets, table).permute(2, 0, 1)[None].to(q.dtype)  # [1, heads, tq, tk]
    allowed = None
    if causal:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)[None, None]
    if keys is not None:
        allowed = keys if allowed is None else allowed & keys
    if allowed is not None:
        bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)
    return layers.sdpa(q, k, v, attn_mask=bias, scale=1.0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None = None,
           buckets: torch.Tensor | None = None, keys: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """Attention of ``q [batch, tq, heads, head_dim]`` over ``k``, ``v`` with the relative
    bias ``table[buckets]`` (self-attention; none for cross-attention), only to the keys
    ``keys [batch, 1, 1, tk]`` allows and, with ``causal``, to keys at or before the query
    (the queries being the last ``tq`` of the ``tk`` positions)."""
    args, axes = [q, k, v], [_QKV_AXES, _QKV_AXES, _QKV_AXES]
    for t, a in ((table, _TABLE_AXES), (buckets, _BUCKET_AXES), (keys, _KEYS_AXES)):
        if t is not None:
            args.append(t)
            axes.append(a)
    present = (table is not None, buckets is not None, keys is not None)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        it = iter(rest)
        table_, buckets_, keys_ = (next(it) if p else None for p in present)
        return _attend(q, k, v, table_, buckets_, keys_, causal)

    return local(run, tuple(axes), _QKV_AXES)(*args)


def _heads(p: dict, x: torch.Tensor, name: str) -> torch.Tensor:
    return layers.project_to_heads(x, p[name])


def self_attention(p: dict, x: torch.Tensor, table: torch.Tensor, buckets: torch.Tensor,
                   keys: torch.Tensor | None, causal: bool, cache: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The attention output, and the keys and values it read: ``x``'s, after ``cache``'s
    (the positions before ``x`` when decoding)."""
    q, k, v = (_heads(p, x, w) for w in ("wq", "wk", "wv"))
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
    return layers.project_from_heads(attend(q, k, v, table, buckets, keys, causal), p["wo"]), (k, v)


def cross_attention(p: dict, x: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor],
                    keys: torch.Tensor | None) -> torch.Tensor:
    q = _heads(p, x, "wq")
    return layers.project_from_heads(attend(q, *memory_kv, keys=keys), p["wo"])


def memory_kv(p: dict, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder block's cross-attention keys and values of the encoder's output: computed
    once per source when decoding."""
    return _heads(p["cross"], memory, "wk"), _heads(p["cross"], memory, "wv")


def norm(x: torch.Tensor, p: dict, cfg: Config) -> torch.Tensor:
    """T5's layer norm: no mean, no bias; the mean square in fp32, the input scaled in its own
    dtype (or fp32, whichever is wider), and cast to a half-precision scale's dtype before
    it is applied — Hugging Face's order, which float64 comparisons and bf16 runs see."""
    scale = p["scale"]
    y = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    if scale.dtype in (torch.float16, torch.bfloat16):
        y = y.to(scale.dtype)
    return scale * y


def feed_forward(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = layers.linear(x, p["w_in"])
    h = layers.gelu_tanh(layers.linear(x, p["w_gate"])) * h if "w_gate" in p else torch.relu(h)
    return layers.linear(shard(h, "batch", "ctx", "mlp"), p["w_out"])


def _residual(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    # a sublayer's output (a partial sum under tp) reduced onto the whole sequence, then added
    return x + shard(update, "batch", "ctx", "embed")


def encoder_layer(p: dict, x: torch.Tensor, table: torch.Tensor, buckets: torch.Tensor,
                  source_keys: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """One encoder block on the source ``x [batch, src, embed]``."""
    x = _residual(x, self_attention(p["attn"], norm(x, p["attn_norm"], cfg), table, buckets, source_keys, False)[0])
    return _residual(x, feed_forward(p["mlp"], norm(x, p["mlp_norm"], cfg)))


def decoder_layer(p: dict, y: torch.Tensor, memory: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor,
                  buckets: torch.Tensor, source_keys: torch.Tensor | None, cfg: Config,
                  cache: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoder block on the target ``y [batch, tgt, embed]``: causal self-attention,
    cross-attention over ``memory`` (the block's ``memory_kv``), feed-forward. With ``cache``
    (the keys and values of the targets before ``y``) it returns ``(y, extended cache)``."""
    out, kv = self_attention(p["attn"], norm(y, p["attn_norm"], cfg), table, buckets, None, True, cache)
    y = _residual(y, out)
    y = _residual(y, cross_attention(p["cross"], norm(y, p["cross_norm"], cfg), memory, source_keys))
    y = _residual(y, feed_forward(p["mlp"], norm(y, p["mlp_norm"], cfg)))
    return y if cache is None else (y, kv)


# ---------------------------------------------------------------------------------------
# the pieces: embedding, blocks and head on the joint stream


def attend_inputs(cfg: Config, seq_len: int, device: torch.device, valid: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> T5Attend:
    """The step's relative-position buckets of both stacks and the source's padding mask
    (``valid [batch, src + tgt]``: 1 for tokens), built once for every block."""
    src, tgt = cfg.encoder_seq_len, seq_len - cfg.encoder_seq_len
    if tgt <= 0:
        raise ConfigError(f"a T5 stream of {seq_len} positions has no target side after the {src} source positions "
                          f"(model.encoder_seq_len)")

    def buckets(n: int, bidirectional: bool) -> torch.Tensor:
        pos = torch.arange(n, device=device)
        out = relative_buckets(pos, pos, bidirectional, cfg.relative_buckets, cfg.relative_max_distance)
        return shard(out, None, None)  # a plain table, replicated under a sharding plan

    keys = None
    if valid is not None:
        keys = local(lambda v: v[:, None, None, :src].bool(), (("batch", None),), _KEYS_AXES)(valid)
    return T5Attend(src, buckets(src, True), buckets(tgt, False), keys)


def embed(params: dict, tokens: torch.Tensor, cfg: Config, decoder_inputs: torch.Tensor) -> torch.Tensor:
    """The stream's start: the shared embedding of the source ``tokens [batch, src]`` and the
    decoder's inputs ``[batch, tgt]``, side by side (T5 adds no position embedding)."""
    if tokens.shape[1] != cfg.encoder_seq_len:
        raise ConfigError(f"T5 source of {tokens.shape[1]} tokens: the stream expects model.encoder_seq_len="
                          f"{cfg.encoder_seq_len} (pad the source to it)")
    both = torch.cat([tokens, decoder_inputs], dim=1)
    return shard(F.embedding(both, params["embed"]["tokens"]), "batch", "seq", "embed")


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None,
          attend: T5Attend | None = None) -> torch.Tensor:
    """One block on the stream ``x [batch, src + tgt, embed]``: an encoder block changes the
    source part, a decoder block the target part (the first also normalises the source part
    into the memory). ``p`` holds the block's parameters and the shared ``relative`` tables.
    Sublayers read the whole sequence; the result goes back to the stream's layout (split
    along the sequence under sequence parallelism)."""
    if attend is None:
        attend = attend_inputs(cfg, x.shape[1], x.device, valid)
    h = shard(x, "batch", "ctx", "embed")
    src, tgt = h[:, :attend.split], h[:, attend.split:]
    if "cross" not in p:
        src = encoder_layer(p, src, p["relative"]["encoder"], attend.encoder_buckets, attend.source_keys, cfg)
    else:
        if "encoder_norm" in p:
            src = norm(src, p["encoder_norm"], cfg)
        tgt = decoder_layer(p, tgt, memory_kv(p, src), p["relative"]["decoder"], attend.decoder_buckets,
                            attend.source_keys, cfg)
    return shard(torch.cat([src, tgt], dim=1), "batch", "seq", "embed")


def final_hidden(params: dict, y: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The decoder's final norm, scaled by d_model^-1/2 when the head is the embedding."""
    y = norm(y, params["head"]["norm"], cfg)
    return y * cfg.d_model ** -0.5 if cfg.tie_embeddings else y


def output_weight(params: dict) -> torch.Tensor:
    """The output projection ``[embed, vocab]``: the embedding (tied) or the head's own."""
    return params["head"]["w"] if "w" in params["head"] else params["embed"]["tokens"].t()


def logits(params: dict, y: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``[batch, tgt, vocab]`` of the decoder's output ``y``."""
    out = layers.linear(shard(final_hidden(params, y, cfg), "batch", "ctx", "embed"), output_weight(params),
                        role="head")
    return shard(out, "batch", "ctx", "vocab")


def head(params: dict, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits of the stream's target part."""
    return logits(params, shard(x, "batch", "ctx", "embed")[:, cfg.encoder_seq_len:], cfg)


def forward(params: dict, tokens: torch.Tensor, decoder_inputs: torch.Tensor, cfg: Config,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, tgt, vocab]`` for source ``tokens [batch, encoder_seq_len]`` and
    ``decoder_inputs [batch, tgt]``; ``attention_mask [batch, src + tgt]`` (1 for tokens) for
    padded sources. The forward by pieces every training path runs (``run_pieces``)."""
    return run_pieces(FAMILY, params, params, tokens, cfg, recompute.plain_call,
                      inputs=(decoder_inputs,), valid=attention_mask)


def example_batch(cfg: Config, batch: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A batch of the shapes training feeds (zeros): for shape checks on the meta device."""
    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(batch, n, dtype=torch.long, device=device)
    return {"inputs": zeros(cfg.encoder_seq_len), "decoder_inputs": zeros(cfg.decoder_seq_len),
            "targets": zeros(cfg.decoder_seq_len)}


def shift_right(targets: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The decoder's inputs for ``targets``: the start token (T5's pad), then the targets but the last."""
    start = torch.full_like(targets[:, :1], cfg.pad_id)
    return torch.cat([start, targets[:, :-1]], dim=1)


# ---------------------------------------------------------------------------------------
# encoding once, decoding with a cache (generation)


class Memory(NamedTuple):
    """The encoder's output as every decoder block reads it: per decoder block its
    cross-attention keys and values, and the source's padding mask."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    source_keys: torch.Tensor | None


def _blocks(params: dict, cfg: Config) -> tuple[list[dict], list[dict]]:
    blocks = params["blocks"]
    return blocks[:cfg.n_encoder_layers], blocks[cfg.n_encoder_layers:]


def encode(params: dict, tokens: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None) -> Memory:
    """The source ``tokens [batch, src]`` (any length; ``valid``: 1 for tokens) through the
    encoder and its final norm, and each decoder block's cross-attention keys and values."""
    encoder, decoder = _blocks(params, cfg)
    x = shard(F.embedding(tokens, params["embed"]["tokens"]), "batch", "ctx", "embed")
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    buckets = relative_buckets(pos, pos, True, cfg.relative_buckets, cfg.relative_max_distance)
    keys = None if valid is None else valid[:, None, None, :].bool()
    for p in encoder:
        x = encoder_layer(p, x, params["relative"]["encoder"], buckets, keys, cfg)
    x = norm(x, decoder[0]["encoder_norm"], cfg)
    return Memory([memory_kv(p, x) for p in decoder], keys)


def decode(params: dict, tokens: torch.Tensor, memory: Memory, cfg: Config,
           cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
           ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits of the decoder's new input ``tokens [batch, new]`` following the ``cache`` (each
    decoder block's self-attention keys and values of the tokens before; None: none yet),
    and the extended cache."""
    _, decoder = _blocks(params, cfg)
    past = 0 if cache is None else cache[0][0].shape[1]
    new = tokens.shape[1]
    y = shard(F.embedding(tokens, params["embed"]["tokens"]), "batch", "ctx", "embed")
    buckets = relative_buckets(torch.arange(past, past + new, device=tokens.device),
                               torch.arange(past + new, device=tokens.device), False, cfg.relative_buckets,
                               cfg.relative_max_distance)
    out = []
    empty = torch.zeros(y.shape[0], 0, cfg.n_heads, cfg.d_kv, dtype=y.dtype, device=y.device)
    for i, p in enumerate(decoder):
        y, kv = decoder_layer(p, y, memory.kv[i], params["relative"]["decoder"], buckets, memory.source_keys, cfg,
                              cache=(empty, empty) if cache is None else cache[i])
        out.append(kv)
    return logits(params, y, cfg), out


FAMILY = ModelFamily(
    name="t5", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head, objective=objective,
    EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS,
    BLOCK_SHARED_PARAMS=BLOCK_SHARED_PARAMS, attend_inputs=attend_inputs, block_saved=keeps(BLOCK_SAVED),
    final_hidden=final_hidden, output_weight=output_weight, encode=encode, decode=decode,
    example_batch=example_batch, check_mesh=check_mesh,
)
