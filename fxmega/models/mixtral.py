"""Mixture-of-experts Llama: Mixtral (Jiang et al. 2024: every block's MLP replaced by 8
SwiGLU experts, each token through its top 2), and with ``model.moe`` settings the
DeepSeek-MoE shape (Dai et al. 2024: many fine-grained experts, shared experts every token
passes through, the first layers dense) and Qwen-MoE's.

Llama's attention, norms, embedding and head (``fxmega.models.llama``); the feed-forward
sublayer of block ``i`` is ``fxmega.ops.moe.moe_ffn`` when ``moe.is_moe_layer(i)``, else
Llama's dense MLP of width ``d_ff``. Architecture only: the balancing terms reach the
gradient through ``fxmega.ops.aux_loss``, under whatever step differentiates the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.models import llama
from fxmega.models.census import Saved
from fxmega.models.family import ModelFamily
from fxmega.models.llama import (  # noqa: F401  (the family's pieces, shared with Llama)
    EMBED_INPUTS,
    EMBED_PARAMS,
    HEAD_PARAMS,
    POOL_PARAMS,
    attend_inputs,
    decode_write,
    embed,
    final_hidden,
    head,
    kv_cache_shape,
    objective,
    output_weight,
    pool,
)
from fxmega.ops import aux_loss, layers, moe
from fxmega.ops.moe import MoE
from fxmega.sharding.mesh import MeshSpec


@dataclass(frozen=True)
class Config(llama.Config):
    moe: MoE = field(default_factory=lambda: MoE(n_experts=8, top_k=2))

    def validate(self, prefix: str = "model") -> None:
        super().validate(prefix)
        self.moe.validate(f"{prefix}.moe")
        if not self.moe.enabled:
            raise ConfigError(f"{prefix}.moe.n_experts=0: a model without experts is a llama; give n_experts >= 1")
        if self.moe.first_dense_layers >= self.n_layers:
            raise ConfigError(f"{prefix}.moe.first_dense_layers={self.moe.first_dense_layers} leaves none of the "
                              f"{self.n_layers} layers with experts")


# Each sequence's balancing terms need the whole sequence on one rank: not split over cp yet.
CONTEXT_PARALLEL = False


def block_saved(cfg: Config, index: int, seq_len: int, ep: int) -> tuple[Saved, ...]:
    """What block ``index`` keeps for its backward (``fxmega.models.census``), per token of
    sequences of ``seq_len``, its experts spread over ``ep`` ranks: Llama's norms and
    attention, then its feed-forward's (``feed_forward_saved``)."""
    return llama.SAVED_BESIDE_MLP + feed_forward_saved(cfg, index, seq_len, ep)


def feed_forward_saved(cfg: Config, index: int, seq_len: int, ep: int) -> tuple[Saved, ...]:
    """What block ``index``'s feed-forward keeps for its backward: Llama's MLP where the block
    is dense; else the router (fp32 logits and scores, the top-k choice), the (token, expert)
    pairs, the experts' SwiGLU on the rows they run (``k`` per token dropless,
    ``moe.buffer_rows`` per sequence through buffers), the weighted outputs, and the shared
    experts' MLP (shared with DeepSeek-V3, whose blocks have the same feed-forward)."""
    if not cfg.moe.is_moe_layer(index):
        return llama.mlp_saved()
    k = cfg.moe.top_k
    buffered = moe.buffer_rows(cfg.moe, seq_len, ep) * cfg.moe.n_experts / seq_len  # rows per token
    rows = buffered or k
    router = (
        Saved("moe.router_input_fp32", 1, "embed", "fp32_copy", False, "norm_out"),
        Saved("moe.router_logits", 1, "experts", "fp32", False, "matmul"),
        Saved("moe.router_probs", 1, "experts", "fp32", False, "other"),
        Saved("moe.router_lse", 1, "one", "fp32", False, "other"),
        Saved("moe.topk_indices", k, "one", "int64", False, "other"),
        Saved("moe.topk_weights", k, "one", "fp32", False, "other"),
        Saved("moe.topk_sum", 1, "one", "fp32", False, "other"),
    )
    pairs = (
        Saved("moe.pair_tokens", k, "one", "int64", False, "other"),
        Saved("moe.pair_weights", k, "one", "act", False, "other"),
    )
    expert_mlp = (
        Saved("moe.gate", rows, "expert_mlp", "act", False, "matmul"),
        Saved("moe.up", rows, "expert_mlp", "act", False, "matmul"),
        Saved("moe.silu", rows, "expert_mlp", "act", False, "other"),
        Saved("moe.hidden", rows, "expert_mlp", "act", False, "other"),
    )
    if buffered:  # each pair's row and whether it fit, the buffers, the experts' outputs on them
        routed = (
            Saved("moe.pair_rows", k, "one", "int64", False, "other"),
            Saved("moe.pair_kept", k, "one", "bool", False, "other"),
            Saved("moe.pair_inputs", k, "embed", "act", False, "gathered"),
            Saved("moe.buffers", rows, "embed", "act", False, "other"),
            *expert_mlp,
            Saved("moe.down_out", rows, "embed", "act", False, "combined"),
            Saved("moe.pair_outputs", 2 * k, "embed", "act", False, "gathered"),
        )
    else:  # the pairs sorted by expert, their rows through the experts, the weighted outputs
        routed = (
            Saved("moe.pair_order", k, "one", "int64", False, "other"),
            Saved("moe.pair_inputs", k, "embed", "act", False, "other"),
            *expert_mlp,
            Saved("moe.down_out", k, "embed", "act", False, "other"),
            Saved("moe.pair_outputs", k, "embed", "act", False, "gathered"),
        )
    shared = llama.mlp_saved("moe.shared", "shared_mlp") if cfg.moe.n_shared_experts else ()
    if cfg.moe.shared_gate:  # the shared experts' output and its gate, for their product's backward
        shared += (Saved("moe.shared_out", 1, "embed", "act", False, "other"),
                   Saved("moe.shared_gate", 1, "one", "act", False, "other"))
    return router + pairs + routed + shared


def check_mesh(cfg: Config, mesh: MeshSpec) -> None:
    """What experts do not run on yet, refused before anything is built."""
    if mesh.size("cp") > 1:
        raise ConfigError(f"--mesh {mesh.describe()}: the mixtral family does not split over cp yet (each "
                          f"sequence's balancing terms are computed on the whole sequence): use the data axes "
                          f"(dp, fsdp, ZeRO), tp and pp with experts")


def feed_forward_specs(cfg: Config, index: int) -> dict:
    """Block ``index``'s feed-forward parameters: ``{"moe": ...}`` where it has experts, else
    Llama's ``{"mlp": ...}`` of width ``d_ff`` (DeepSeek-V3's blocks have the same)."""
    if cfg.moe.is_moe_layer(index):
        weight, residual = llama.inits(cfg)
        return {"moe": moe.param_specs(cfg.moe, cfg.d_model, cfg.d_ff, weight, residual)}
    return llama.mlp_specs(cfg, cfg.d_ff)


def param_specs(cfg: Config) -> dict:
    return llama.specs_with_blocks(cfg, [llama.block_specs(cfg, feed_forward_specs(cfg, i))
                                         for i in range(cfg.n_layers)])


def feed_forward(p: dict, h: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Experts where the block has them (``p["moe"]``, with its shared experts as Llama's MLP
    beside them, gated per token where the layer has ``shared_gate``), else the dense MLP."""
    if "moe" not in p:
        return llama.mlp(p["mlp"], h)
    y = moe.moe_ffn(p["moe"], h, cfg.moe, valid)
    if "shared" not in p["moe"]:
        return y
    shared = llama.mlp(p["moe"]["shared"], h)
    if "shared_gate" in p["moe"]:  # Qwen2-MoE: how much of the shared experts each token takes
        shared = shared * torch.sigmoid(layers.linear(h, p["moe"]["shared_gate"]))
    return y + shared


def block(p: dict, x: torch.Tensor, cfg: Config, valid: torch.Tensor | None = None,
          attend: layers.Attend | None = None, cache: layers.KV | None = None,
          write: layers.CacheWrite | None = None) -> torch.Tensor | tuple[torch.Tensor, layers.KV]:
    """One block: Llama's attention, then experts or the dense MLP (``feed_forward``)."""
    return llama.residual_block(p, x, cfg, feed_forward, valid, attend, cache, write)


def forward(params: dict, tokens: torch.Tensor, cfg: Config,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` for ``tokens [batch, seq]``."""
    x = embed(params, tokens, cfg)
    attend = attend_inputs(cfg, tokens.shape[1], tokens.device, attention_mask)
    for p in params["blocks"]:
        x = block(p, x, cfg, attention_mask, attend)
    return head(params, x, cfg)


def active_params(cfg: Config) -> int:
    """Parameters one token passes through: everything but the experts it was not routed to
    (the embedding row it reads counts whole, as the published "active" figures count it)."""
    return sum(s.numel for s in tree.leaves(param_specs(cfg))) - idle_expert_params(cfg)


def idle_expert_params(cfg: Config) -> int:
    """Routed-expert parameters a token skips: in every MoE block, the three matrices of each
    expert it was not sent to (shared by the families that use this feed-forward)."""
    idle = cfg.moe.n_experts - cfg.moe.top_k
    moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers))
    return moe_layers * idle * 3 * cfg.d_model * cfg.moe.expert_width(cfg.d_ff)


FAMILY = ModelFamily(
    name="mixtral", Config=Config, param_specs=param_specs, embed=embed, block=block, head=head, objective=objective,
    EMBED_PARAMS=EMBED_PARAMS, HEAD_PARAMS=HEAD_PARAMS, EMBED_INPUTS=EMBED_INPUTS, attend_inputs=attend_inputs,
    CONTEXT_PARALLEL=CONTEXT_PARALLEL, block_saved=block_saved, final_hidden=final_hidden,
    output_weight=output_weight, POOL_PARAMS=POOL_PARAMS, pool=pool, kv_cache_shape=kv_cache_shape,
    decode_write=decode_write, active_params=active_params, check_mesh=check_mesh,
    meter_stats=lambda cfg: aux_loss.ROUTER_STATS,
    experts=lambda cfg: cfg.moe if cfg.moe.enabled else None, kv_heads=lambda cfg: cfg.kv_heads,
)
