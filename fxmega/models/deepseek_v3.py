"""DeepSeek-V3 (DeepSeek-AI 2024), as published: multi-head latent attention (MLA), DeepSeekMoE
feed-forward layers after the first dense ones, RMSNorm, an untied head.

**MLA.** Queries go through a low-rank bottleneck (``wq_a`` to ``q_lora_rank``, RMSNorm,
``wq_b`` up to the heads); keys and values through a joint one (``wkv_a`` to
``kv_lora_rank``, RMSNorm, ``wkv_b`` up to each head's ``qk_nope_head_dim`` key part and
``v_head_dim`` value), beside one rotary key of ``qk_rope_head_dim`` that ``wkv_a`` also
makes and every head shares. A head's query and key are its no-position part and its
rotated part side by side, so a score is ``q_nope . k_nope + q_rope . k_rope``; the softmax
scale is ``1 / sqrt(qk_nope + qk_rope)`` times YaRN's ``mscale(factor, mscale_all_dim)^2``.
Rotary dims use the rotate-half layout (``fxmega.ops.rope``); DeepSeek's checkpoints pair
them interleaved, which the Hugging Face conversion permutes (``fxmega.storage.hf_deepseek``).

Sharding, by the logical axes: the up-projections (``wq_b``, ``wkv_b``) and the output
projection split by ``heads`` as any attention does, so tp gives each rank whole heads. The
down-projections (``wq_a``, ``wkv_a``) and their norms name ``q_lora`` / ``kv_lora``, which no
rule splits: they are replicated, each tp rank computing the small latents (1536 + 576 wide
for 7168) for its heads rather than sending them, Megatron-Core's choice too.

**DeepSeekMoE** is ``fxmega.ops.moe`` with DeepSeek-V3's settings (sigmoid scores, group-
limited top-k, the selection bias updated from the load outside the gradient, shared
experts, ``route_scale``), the first ``moe.first_dense_layers`` blocks a dense SwiGLU of
``d_ff`` (``fxmega.models.mixtral.feed_forward``).

**Multi-token prediction** (``mtp_depth`` modules; DeepSeek-V3 trains with one). Module ``k``
normalises the embedding of token ``t[i+k]`` and the previous depth's hidden state (the last
block's output for ``k = 1``), each with its own RMSNorm, projects the two side by side
(``eh_proj [2 d, d]``, the embedding first, as the released checkpoint's ``eh_proj`` and
Megatron-Core order them; the report writes the pair the other way round) and runs one
block (MLA and experts, as the last main block) and its own final RMSNorm, then the shared
output head; the embedding and head are the main model's. It lives in the head piece, so on a
pipeline it is on the last stage, which reads the embedding as a tied one. What each depth
predicts, how its loss is weighed (``mtp_loss_weight / mtp_depth`` times its summed loss,
with the main loss's divisor) and reported: ``fxmega.ops.mtp``. The losses join the gradient
only in a training step (``fxmega.ops.aux_loss.attach``): evaluation reports the main loss
and generation never runs the modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.core.spec import ONES, ParamSpec
from fxmega.models import llama, mixtral
from fxmega.models.census import Saved
from fxmega.models.checks import require_positive
from fxmega.models.family import ModelFamily
from fxmega.models.llama import (  # noqa: F401  (the family's pieces, shared with Llama)
    EMBED_INPUTS,
    EMBED_PARAMS,
    HEAD_PARAMS,
    POOL_PARAMS,
    embed,
    final_hidden,
    objective,
    output_weight,
    pool,
)
from fxmega.ops import aux_loss, layers, mtp
from fxmega.ops.moe import MoE
from fxmega.ops.rope import Rope, RopeScaling, apply_rope
from fxmega.sharding.layout import shard
from fxmega.sharding.mesh import MeshSpec


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times (1 unstretched)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class Config:
    """DeepSeek-V3 671B's shape by default (``configs/`` holds smaller ones)."""

    vocab_size: int = 129280
    max_seq_len: int = 4096
    d_model: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    d_ff: int = 18432  # the dense blocks' SwiGLU width (the first moe.first_dense_layers)
    q_lora_rank: int = 1536  # 0: queries projected straight from the residual stream (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    mscale_all_dim: float = 0.0  # YaRN's mscale on the softmax scale, squared (DeepSeek-V3: 1.0); 0: none
    norm_eps: float = 1e-6
    init_std: float = 0.006
    mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3 trains with 1); 0: none
    mtp_loss_weight: float = 0.3  # lambda: the report's 0.3 for the first 10T tokens, 0.1 after
    moe: MoE = field(default_factory=lambda: MoE(
        n_experts=256, top_k=8, d_expert=2048, n_shared_experts=1, first_dense_layers=3, score="sigmoid",
        n_groups=8, topk_groups=4, route_scale=2.5, expert_bias=True))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> float:
        """A head's width as the attention FLOPs see it (``training.metrics``: ``12 L H Q T``
        counts scores and weighted sums over one width): scores run over ``qk_head_dim``,
        sums over ``v_head_dim``, so the mean of the two."""
        return (self.qk_head_dim + self.v_head_dim) / 2

    @property
    def rope(self) -> Rope:
        return Rope(self.rope_theta, self.rope_scaling)

    @property
    def softmax_scale(self) -> float:
        """``1 / sqrt(qk_head_dim)``, times YaRN's ``mscale_all_dim`` temperature squared."""
        s = self.rope_scaling
        mscale = yarn_mscale(s.factor, self.mscale_all_dim) if s.kind == "yarn" and self.mscale_all_dim else 1.0
        return self.qk_head_dim ** -0.5 * mscale * mscale

    def validate(self, prefix: str = "model") -> None:
        require_positive(self, ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff", "kv_lora_rank",
                                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), prefix)
        self.rope_scaling.validate(f"{prefix}.rope_scaling")
        self.moe.validate(f"{prefix}.moe")
        if self.q_lora_rank < 0:
            raise ConfigError(f"{prefix}.q_lora_rank={self.q_lora_rank} must be positive, or 0 for no query "
                              f"compression")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{prefix}.qk_rope_head_dim={self.qk_rope_head_dim} is odd: rotary embeddings rotate "
                              f"pairs of dims")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ConfigError(f"{prefix}.mtp_depth={self.mtp_depth}, {prefix}.mtp_loss_weight={self.mtp_loss_weight}: "
                              f"neither may be negative (mtp_depth=0: no multi-token prediction)")
        if self.mscale_all_dim < 0:
            raise ConfigError(f"{prefix}.mscale_all_dim={self.mscale_all_dim} must not be negative")
        if not self.moe.enabled:
            raise ConfigError(f"{prefix}.moe.n_experts=0: DeepSeek-V3's blocks after the first dense ones have "
                              f"experts; give n_experts >= 1")
        if self.moe.first_dense_layers >= self.n_layers:
            raise ConfigError(f"{prefix}.moe.first_dense_layers={self.moe.first_dense_layers} leaves none of the "
                              f"{self.n_layers} layers with experts")


def attention_specs(cfg: Config) -> dict:
    """MLA's parameters (see the module docstring for what each one is and how it is split)."""
    d, h, nope, rope, v = cfg.d_model, cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    weight, residual = llama.inits(cfg)
    if cfg.q_lora_rank:
        queries = {"wq_a": ParamSpec((d, cfg.q_lora_rank), ("embed", "q_lora"), weight),
                   "q_norm": {"scale": ParamSpec((cfg.q_lora_rank,), ("q_lora",), ONES)},
                   "wq_b": ParamSpec((cfg.q_lora_rank, h, nope + rope), ("q_lora", "heads", "head_dim"), weight)}
    else:
        queries = {"wq": ParamSpec((d, h, nope + rope), ("embed", "heads", "head_dim"), weight)}
    return {
        **queries,
        "wkv_a": ParamSpec((d, cfg.kv_lora_rank + rope), ("embed", "kv_lora"), weight),
        "kv_norm": {"scale": ParamSpec((cfg.kv_lora_rank,), ("kv_lora",), ONES)},
        "wkv_b": ParamSpec((cfg.kv_lora_rank, h, nope + v), ("kv_lora", "heads", "head_dim"), weight),
        "wo": ParamSpec((h, v, d), ("heads", "head_dim", "embed"), residual),
    }


def block_specs(cfg: Config, index: int) -> dict:
    """Block ``index``'s parameters: the norms, MLA, and experts or the dense MLP."""
    d = cfg.d_model
    return {"attn_norm": {"scale": ParamSpec((d,), ("embed",), ONES)}, "attn": attention_specs(cfg),
            "mlp_norm": {"scale": ParamSpec((d,), ("embed",), ONES)}, **mixtral.feed_forward_specs(cfg, index)}


def mtp_specs(cfg: Config, k: int) -> dict:
    """Multi-token prediction module ``k``'s parameters (1-based): the two input norms, the
    projection of their concatenation (replicated over tp: 2 d x d, small beside a block; its
    input dim names ``mtp_in``, which no rule splits), a block (with experts, as the blocks
    after the first dense ones) and its final norm."""
    d = cfg.d_model
    weight, _ = llama.inits(cfg)
    return {"enorm": {"scale": ParamSpec((d,), ("embed",), ONES)},
            "hnorm": {"scale": ParamSpec((d,), ("embed",), ONES)},
            "eh_proj": ParamSpec((2 * d, d), ("mtp_in", "embed"), weight),
            "block": block_specs(cfg, cfg.n_layers + k - 1),
            "norm": {"scale": ParamSpec((d,), ("embed",), ONES)}}


def param_specs(cfg: Config) -> dict:
    specs = llama.specs_with_blocks(cfg, [block_specs(cfg, i) for i in range(cfg.n_layers)])
    if cfg.mtp_depth:
        specs["mtp"] = [mtp_specs(cfg, k) for k in range(1, cfg.mtp_depth + 1)]
    return specs


# The head reads the batch's targets (and masks) for multi-token prediction, and with it
# the embedding and the modules; a model without modules reads what Llama's head reads.
HEAD_INPUTS = ("targets", "loss_mask", "attention_mask")
MTP_GROUPS = ("embed", "mtp")


def head_groups(params: dict) -> tuple[str, ...]:
    """The head's groups: Llama's, and the embedding and the MTP modules where there are some."""
    return HEAD_PARAMS + MTP_GROUPS if "mtp" in params else HEAD_PARAMS


def latent_norm_saved(name: str, width: int) -> tuple[Saved, ...]:
    """What RMSNorm of a latent ``width`` wide keeps (replicated over tp, as the latent is):
    its fp32 input, the statistics, the normalised values, and its output, which the
    up-projection reads."""
    return (Saved(f"{name}.input_fp32", width, "one", "fp32", False, "other"),
            Saved(f"{name}.rstd", 1, "one", "fp32", False, "other"),
            Saved(f"{name}.normed", width, "one", "act", False, "other"),
            Saved(f"{name}.output", width, "one", "act", False, "norm_out"))


def attention_saved(cfg: Config) -> tuple[Saved, ...]:
    """What MLA keeps for its backward, per token (``fxmega.models.census``): the query and
    key-value latents through their norms (whole on every tp rank), each local head's query
    and key (``qk_head_dim`` wide: the no-position part and the rotated one side by side, the
    shared rotary key copied to every head) and value (``v_head_dim``), the attention's output
    and log-sum-exp (a fused kernel's), and the output projection's partial sum."""
    latents = latent_norm_saved("attn.q_norm", cfg.q_lora_rank) if cfg.q_lora_rank else ()
    return latents + latent_norm_saved("attn.kv_norm", cfg.kv_lora_rank) + (
        Saved("attn.q", cfg.qk_head_dim, "heads", "act", False, "matmul"),
        Saved("attn.k", cfg.qk_head_dim, "heads", "act", False, "matmul"),
        Saved("attn.v", cfg.v_head_dim, "heads", "act", False, "matmul"),
        Saved("attn.out", cfg.v_head_dim, "heads", "act", False, "attention"),
        Saved("attn.lse", 1, "heads", "fp32", False, "attention"),
        Saved("attn.wo_out", 1, "embed", "act", False, "projection_out"))


def block_saved(cfg: Config, index: int, seq_len: int, ep: int) -> tuple[Saved, ...]:
    """What block ``index`` keeps for its backward: Llama's norms, MLA's tensors
    (``attention_saved``) and the feed-forward's, dense or experts (``mixtral.feed_forward_saved``)."""
    return llama.NORMS_SAVED + attention_saved(cfg) + mixtral.feed_forward_saved(cfg, index, seq_len, ep)


def attend_inputs(cfg: Config, seq_len: int, device: torch.device, valid: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> layers.Attend:
    """The rotary tables of the ``qk_rope_head_dim`` rotated dims, and the mask padding needs."""
    return layers.attend_inputs(seq_len, device, cfg.rope, cfg.qk_rope_head_dim, valid, positions)


def _queries_and_latent(p: dict, x: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, ...]:
    """``x``'s queries split into their no-position and rotary parts ``[batch, seq, heads, *]``,
    its normalised key-value latent ``[batch, seq, kv_lora_rank]`` and its (not yet rotated)
    shared rotary key ``[batch, seq, qk_rope_head_dim]``."""
    if "wq_a" in p:
        latent_q = layers.rms_norm(layers.linear(x, p["wq_a"]), p["q_norm"]["scale"], cfg.norm_eps)
        q = layers.project_to_heads(latent_q, p["wq_b"])
    else:
        q = layers.project_to_heads(x, p["wq"])
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    latent_kv, k_rope = layers.linear(x, p["wkv_a"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return q_nope, q_rope, layers.rms_norm(latent_kv, p["kv_norm"]["scale"], cfg.norm_eps), k_rope


def attention(p: dict, x: torch.Tensor, cfg: Config, attend: layers.Attend) -> torch.Tensor:
    """Multi-head latent attention over ``x [batch, seq, embed]`` (causal, rotary tables in
    ``attend``)."""
    q_nope, q_rope, latent_kv, k_rope = _queries_and_latent(p, x, cfg)
    k_nope, v = layers.project_to_heads(latent_kv, p["wkv_b"]).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    cos, sin = attend.rotary.unbind(0)
    q_rope = apply_rope(q_rope, cos, sin)
    # one rotary key for every head; under tp each rank takes its heads' share of the (replicated) copies
    k_rope = shard(apply_rope(k_rope.unsqueeze(-2), cos, sin).expand(*k_nope.shape[:-1], cfg.qk_rope_head_dim),
                   "batch", None, "heads", "head_dim")
    # SDPA scales by 1 / sqrt(qk_head_dim); the rest of the scale (YaRN's temperature) on the queries
    extra = cfg.softmax_scale * math.sqrt(cfg.qk_head_dim)
    q = torch.cat([q_nope, q_rope], dim=-1)
    q = q if extra == 1.0 else q * extra
    out = layers.causal_attention(q, torch.cat([k_nope, k_rope], dim=-1), v, attend._replace(rotary=None))
    return layers.project_from_heads(out, p["wo"])


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None,
          attend: layers.Attend | None = None, cache: layers.KV | None = None,
          write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """One pre-norm block: MLA, then experts or the dense MLP (``mixtral.feed_forward``). With
    ``cache`` and ``write`` it decodes over the latent cache (``cached_attention``) and returns
    ``(x, updated cache)``."""
    h = shard(layers.rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps), "batch", "ctx", "embed")
    if cache is not None:
        a, cache = cached_attention(p["attn"], h, cfg, cache, write)
    else:
        a = attention(p["attn"], h, cfg, attend if attend is not None else attend_inputs(cfg, x.shape[1], x.device,
                                                                                           valid))
    x = x + shard(a, "batch", "seq", "embed")
    h = shard(layers.rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps), "batch", "ctx", "embed")
    x = x + shard(mixtral.feed_forward(p, h, cfg, valid), "batch", "seq", "embed")
    return x if cache is None else (x, cache)


def head(params: dict, x: torch.Tensor, cfg: Config, targets: torch.Tensor | None = None,
         loss_mask: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The main logits (final RMSNorm, output projection). In a training step, given the
    batch's ``targets``, the multi-token prediction losses ride on them into the gradient
    (``mtp_loss_sums``; weighed as ``fxmega.ops.mtp`` says) and each depth's summed loss and
    target count reach the step's meter."""
    logits = llama.head(params, x, cfg)
    if not cfg.mtp_depth or targets is None or not aux_loss.in_step():
        return logits
    sums = mtp_loss_sums(params, x, cfg, targets, loss_mask, valid)
    logits = aux_loss.attach(logits, sum(loss for loss, _ in sums) * (cfg.mtp_loss_weight / cfg.mtp_depth))
    names = mtp.stat_names(cfg.mtp_depth)
    if aux_loss.measuring(names):
        stats = torch.stack([v.detach().float() for loss, n in sums for v in (loss, n)])
        logits = aux_loss.measure(logits, stats, names)
    return logits


def mtp_loss_sums(params: dict, x: torch.Tensor, cfg: Config, targets: torch.Tensor,
                  loss_mask: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MTP depth, its summed cross-entropy (fp32, replicated over tp) and its number of
    targets, from the last block's output ``x [batch, seq, embed]`` and the batch's
    ``targets`` and ``loss_mask`` (``valid``: the batch's attention mask, for the modules'
    blocks)."""
    attend = attend_inputs(cfg, x.shape[1], x.device, valid)
    h, out = x, []
    for k, p in enumerate(params["mtp"], start=1):
        e = layers.rms_norm(embed(params, mtp.shift(targets, k - 1), cfg), p["enorm"]["scale"], cfg.norm_eps)
        both = torch.cat([e, layers.rms_norm(h, p["hnorm"]["scale"], cfg.norm_eps)], dim=-1)
        h = block(p["block"], shard(layers.linear(both, p["eh_proj"]), "batch", "seq", "embed"), cfg, valid, attend)
        logits = llama.head({"final_norm": p["norm"], "head": output_weight(params)}, h, cfg)  # its own norm
        mask = mtp.depth_mask(targets, loss_mask, k)
        loss = layers.cross_entropy_sum(logits, mtp.shift(targets, k), mask, cfg.vocab_size)
        out.append((shard(loss), shard(mask.sum())))
    return out


# ---- decoding over the latent cache ------------------------------------------------------------
# Each block caches what MLA compresses a token to: its normalised key-value latent
# (kv_lora_rank) and its rotated shared key (qk_rope_head_dim), not every head's key and value.
# The new tokens' queries are taken into the latent space instead (DeepSeek-V2's absorption):
# q_nope . (c W_uk) = (q_nope W_uk^T) . c, and the weighted sum of values is the weighted sum of
# latents through W_uv; so attention runs as one key-value head of width kv_lora_rank +
# qk_rope_head_dim, and the cache is never expanded to heads.

def kv_cache_shape(cfg: Config, batch: int, max_len: int) -> tuple[int, ...]:
    """Each block's cached latents ``[batch, max_len, 1, kv_lora_rank]``."""
    return (batch, max_len, 1, cfg.kv_lora_rank)


def rope_cache_shape(cfg: Config, batch: int, max_len: int) -> tuple[int, ...]:
    """Each block's cached rotary keys ``[batch, max_len, 1, qk_rope_head_dim]``."""
    return (batch, max_len, 1, cfg.qk_rope_head_dim)


def cache_bytes_per_token(cfg: Config, dtype_bytes: int = 2) -> int:
    """What decoding caches per token over all blocks: ``kv_lora_rank + qk_rope_head_dim``
    values a block."""
    return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes


def decode_write(cfg: Config, start: int, new: int, max_len: int, pad: torch.Tensor) -> layers.CacheWrite:
    """Where ``new`` tokens go in the cache, with the rotary tables of the rotated dims."""
    return layers.cache_write(start, new, max_len, pad, cfg.qk_rope_head_dim, cfg.rope)


def cached_attention(p: dict, x: torch.Tensor, cfg: Config, cache: layers.KV,
                     write: layers.CacheWrite) -> tuple[torch.Tensor, layers.KV]:
    """MLA of new tokens ``x [batch, new, embed]`` over the latent cache: their latents and
    rotary keys written at ``write.start``, their queries absorbed into the latent space."""
    q_nope, q_rope, latent_kv, k_rope = _queries_and_latent(p, x, cfg)
    q_rope = apply_rope(q_rope, write.cos, write.sin)
    k_rope = apply_rope(k_rope.unsqueeze(-2), write.cos, write.sin)
    cache_c, cache_r = cache
    end = write.start + x.shape[1]
    cache_c = torch.slice_scatter(cache_c, latent_kv.unsqueeze(-2).to(cache_c.dtype), dim=1, start=write.start, end=end)
    cache_r = torch.slice_scatter(cache_r, k_rope.to(cache_r.dtype), dim=1, start=write.start, end=end)
    # [kv_lora, heads, nope], [kv_lora, heads, v]
    w_uk, w_uv = p["wkv_b"].split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    q_latent = torch.einsum("bshn,chn->bshc", q_nope, w_uk.to(q_nope.dtype))
    keys = torch.cat([cache_c, cache_r], dim=-1).to(q_latent.dtype)  # one key-value head for every query head
    out = layers.sdpa(torch.cat([q_latent, q_rope], dim=-1), keys, cache_c.to(keys.dtype), attn_mask=write.mask,
                      scale=cfg.softmax_scale, enable_gqa=True)
    out = torch.einsum("bshc,chv->bshv", out, w_uv.to(out.dtype))
    return layers.project_from_heads(out, p["wo"]), (cache_c, cache_r)


def forward(params: dict, tokens: torch.Tensor, cfg: Config,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` for ``tokens [batch, seq]``."""
    x = embed(params, tokens, cfg)
    attend = attend_inputs(cfg, tokens.shape[1], tokens.device, attention_mask)
    for p in params["blocks"]:
        x = block(p, x, cfg, attention_mask, attend)
    return head(params, x, cfg)


def check_mesh(cfg: Config, mesh: MeshSpec) -> None:
    """What context parallelism cannot split, refused before anything is built: MTP's
    shifted targets and the sequence-wise balancing loss each read a whole sequence."""
    if mesh.size("cp") == 1:
        return
    if cfg.mtp_depth:
        raise ConfigError(f"--mesh {mesh.describe()}: multi-token prediction depth k reads the targets k positions "
                          f"on, which at each cp chunk's end lie on another cp rank: set model.mtp_depth=0 to train "
                          f"with cp, or drop cp")
    if cfg.moe.aux_loss_coeff:
        raise ConfigError(f"--mesh {mesh.describe()}: model.moe.aux_loss_coeff={cfg.moe.aux_loss_coeff} weighs a "
                          f"balancing loss per whole sequence, which cp splits over ranks: set it to 0 (the "
                          f"selection bias balances the load without it), or drop cp")


def active_params(cfg: Config) -> int:
    """Parameters one token passes through in the main model: all but the routed experts it
    was not sent to. The MTP modules are left out, as the report's 37B leaves them: they train
    beside the model and generation does not run them (``summary`` prints them apart)."""
    return sum(s.numel for s in tree.leaves(param_specs(cfg))) - mixtral.idle_expert_params(cfg) - mtp_params(cfg)


def mtp_params(cfg: Config) -> int:
    """The MTP modules' parameters (the embedding and head they share are the main model's)."""
    return sum(s.numel for s in tree.leaves([mtp_specs(cfg, k) for k in range(1, cfg.mtp_depth + 1)]))


FAMILY = ModelFamily(
    name="deepseek_v3", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head,
    objective=objective, EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS,
    attend_inputs=attend_inputs, final_hidden=final_hidden, output_weight=output_weight, POOL_PARAMS=POOL_PARAMS,
    pool=pool, active_params=active_params, check_mesh=check_mesh, kv_cache_shape=kv_cache_shape,
    v_cache_shape=rope_cache_shape, decode_write=decode_write, HEAD_INPUTS=HEAD_INPUTS, head_groups_of=head_groups,
    block_saved=block_saved,
    meter_stats=lambda cfg: aux_loss.ROUTER_STATS + mtp.stat_names(cfg.mtp_depth),
    experts=lambda cfg: cfg.moe, CONTEXT_PARALLEL=True,  # attend_inputs takes positions, as Llama's
)
