"""A mixture-of-experts feed-forward layer as a pure function: route each token
(``fxmega.ops.routing``), run its experts (``fxmega.ops.experts``) and attach the balancing
terms to the gradient (``fxmega.ops.aux_loss``). Shared experts are a dense MLP beside it
(``param_specs`` declares them under ``shared``; the model runs them with its own MLP).

``MoE`` holds the settings of Mixtral (8 experts, top 2, softmax, no shared experts),
Qwen3-MoE (fine-grained experts, top 8) and DeepSeek-V3/DeepSeek-MoE (sigmoid scores,
group-limited routing, a selection bias instead of an auxiliary loss, shared experts, the
first layers dense). Parameter axes: experts stack along ``expert``; each expert's hidden
width is ``mlp`` like a dense MLP's, so tensor parallelism splits experts the way it splits
an MLP; the router's output dim is ``expert_logits`` and is never split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxmega.core.errors import ConfigError
from fxmega.core.spec import ZEROS, Init, ParamSpec
from fxmega.ops import aux_loss, experts, routing
from fxmega.sharding.layout import all_to_all, axis_size, local


@dataclass(frozen=True)
class MoE:
    """Where a model uses experts and how (``n_experts=0``: a dense model)."""

    n_experts: int = 0
    top_k: int = 2
    d_expert: int = 0  # each routed expert's hidden width (0: the model's d_ff)
    n_shared_experts: int = 0  # always-on experts of width d_expert each, run as one MLP
    shared_gate: bool = False  # the shared experts' output scaled by a sigmoid gate per token (Qwen2-MoE)
    first_dense_layers: int = 0  # the first layers keep a dense MLP of width d_ff (DeepSeek: 1 or 3)
    score: str = "softmax"  # softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # the k weights sum to 1 (Mixtral, Qwen3, DeepSeek-V3; Qwen2-MoE: False)
    n_groups: int = 1  # group-limited routing (DeepSeek-V3: 8 groups ...
    topk_groups: int = 1  # ... of which 4 are eligible per token)
    route_scale: float = 1.0  # the routed output's factor (DeepSeek-V3: 2.5)
    capacity_factor: float = 0.0  # 0: dropless; else each expert holds factor * T k / E tokens of a sequence
    aux_loss_coeff: float = 0.0  # the load-balancing loss per layer (Mixtral as trained by HF: 0.02)
    z_loss_coeff: float = 0.0  # the router z-loss per layer (ST-MoE: 1e-3)
    expert_bias: bool = False  # DeepSeek-V3's auxiliary-loss-free balancing: a selection bias per expert ...
    bias_update_rate: float = 1e-3  # ... moved this much per step toward the mean load (DeepSeek-V3: 0.001)

    @property
    def enabled(self) -> bool:
        return self.n_experts > 0

    def validate(self, prefix: str = "model.moe") -> None:
        if self.n_experts < 0:
            raise ConfigError(f"{prefix}.n_experts={self.n_experts} must be positive, or 0 for a dense model")
        if not self.enabled:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"{prefix}.top_k={self.top_k} of n_experts={self.n_experts}: need "
                              f"1 <= top_k <= n_experts")
        if self.score not in routing.SCORES:
            raise ConfigError(f"{prefix}.score={self.score!r}: choose one of {', '.join(routing.SCORES)}")
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            raise ConfigError(f"{prefix}.n_groups={self.n_groups} does not divide n_experts={self.n_experts}: "
                              f"each group holds the same number of experts")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ConfigError(f"{prefix}.topk_groups={self.topk_groups}: need 1 <= topk_groups <= "
                              f"n_groups={self.n_groups}")
        eligible = self.topk_groups * self.n_experts // self.n_groups
        if eligible < self.top_k:
            raise ConfigError(f"{prefix}: the {self.topk_groups} best groups hold {eligible} experts, fewer "
                              f"than top_k={self.top_k}: raise topk_groups")
        if self.shared_gate and not self.n_shared_experts:
            raise ConfigError(f"{prefix}.shared_gate=True without shared experts: give n_shared_experts >= 1")
        for name in ("d_expert", "n_shared_experts", "first_dense_layers", "capacity_factor", "aux_loss_coeff",
                     "z_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must not be negative")
        if self.route_scale <= 0:
            raise ConfigError(f"{prefix}.route_scale={self.route_scale} must be positive")

    def expert_width(self, d_ff: int) -> int:
        return self.d_expert or d_ff

    def is_moe_layer(self, index: int) -> bool:
        return self.enabled and index >= self.first_dense_layers


def param_specs(moe: MoE, d_model: int, d_ff: int, weight: Init, residual: Init) -> dict:
    """One MoE layer's parameters: the router ``[embed, expert_logits]``, the routed experts'
    SwiGLU weights stacked along ``expert``, the shared experts' as one dense SwiGLU (and
    with ``shared_gate`` their gate ``[embed, shared_gate]``), and with ``expert_bias`` the
    selection bias (zeros; moved by the load, not by AdamW)."""
    d, e, f = d_model, moe.n_experts, moe.expert_width(d_ff)
    out = {
        "router": ParamSpec((d, e), ("embed", "expert_logits"), weight),
        "w_gate": ParamSpec((e, d, f), ("expert", "embed", "mlp"), weight),
        "w_up": ParamSpec((e, d, f), ("expert", "embed", "mlp"), weight),
        "w_down": ParamSpec((e, f, d), ("expert", "mlp", "embed"), residual),
    }
    if moe.expert_bias:
        out["expert_bias"] = ParamSpec((e,), ("expert_logits",), ZEROS, sign_rate=moe.bias_update_rate)
    if moe.n_shared_experts:
        fs = moe.n_shared_experts * f
        out["shared"] = {
            "w_gate": ParamSpec((d, fs), ("embed", "mlp"), weight),
            "w_up": ParamSpec((d, fs), ("embed", "mlp"), weight),
            "w_down": ParamSpec((fs, d), ("mlp", "embed"), residual),
        }
        if moe.shared_gate:
            out["shared_gate"] = ParamSpec((d, 1), ("embed", "shared_gate"), weight)
    return out


def buffer_rows(moe: MoE, seq_len: int, ep: int) -> int:
    """Rows each expert's buffer holds per sequence of ``seq_len`` tokens: 0 when dropless on
    one rank (no buffers: the pairs sorted by expert), the capacity with a capacity factor,
    and the whole sequence when dropless over ep (no pair can be dropped, and the exchange
    keeps static shapes and no host sync, at E / k times the pairs' rows)."""
    if moe.capacity_factor:
        return experts.capacity(seq_len, moe.top_k, moe.n_experts, moe.capacity_factor)
    return seq_len if ep > 1 else 0


EXPERT_IN = ("expert", "embed", "mlp")  # w_gate, w_up
EXPERT_OUT = ("expert", "mlp", "embed")  # w_down


def _routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, rows: int, sequences: int,
                    n_experts: int) -> torch.Tensor:
    """The routed experts' weighted output for ``x [T, d]``: dropless (``rows`` 0), or through
    buffers of ``rows`` per expert and sequence (``sequences`` of ``T / sequences`` tokens,
    ``buffer_rows``). ``w_*`` hold this rank's experts: all ``n_experts``, or 1/ep of them
    under expert parallelism, where the buffers travel to their experts' ranks and back."""
    if not rows:
        return experts.dropless(x, chosen, weights, w_gate, w_up, w_down).out
    t, d = x.shape
    per_sequence = t // sequences
    sent = experts.capacity_dispatch(x.view(sequences, per_sequence, d), chosen.view(sequences, per_sequence, -1),
                                     weights.view(sequences, per_sequence, -1), n_experts, rows)
    return experts.capacity_combine(_experts_where_they_live(sent.buffers, w_gate, w_up, w_down,
                                                             axis_size("expert")), sent, t)


def _experts_where_they_live(buffers: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                             ep: int) -> torch.Tensor:
    """Every expert's output for its buffer of ``buffers [E, rows, d]``, each expert run on
    the ep rank that holds it: this rank's buffers go to their experts' ranks, which run
    them beside every other rank's, and the outputs come back in the same layout."""
    if ep == 1:
        return experts.stacked_swiglu(buffers, w_gate, w_up, w_down)
    e, rows, d = buffers.shape
    mine = e // ep  # the experts this rank holds: received from ep ranks, [ep, mine, rows, d]
    received = all_to_all(buffers, "expert").view(ep, mine, rows, d).transpose(0, 1).reshape(mine, ep * rows, d)
    y = experts.stacked_swiglu(received, w_gate, w_up, w_down)
    return all_to_all(y.view(mine, ep, rows, d).transpose(0, 1).reshape(e, rows, d), "expert")


def moe_ffn(p: dict, x: torch.Tensor, moe: MoE, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE feed-forward layer on ``x [batch, seq, d]``; ``valid [batch, seq]`` (0 for
    padding, else the token's document) keeps padding out of the balancing terms. Under a training step's
    ``aux_loss.gradient_scale`` the balancing terms join the gradient: per sequence,
    ``aux_loss_coeff x balancing + z_loss_coeff x z``, counted once per token of the sequence
    (so that with the main loss's ``1 / tokens`` it is their mean over sequences). An
    ``expert_bias`` shifts the selection, and receives the tokens per expert as its gradient."""
    b, s, d = x.shape
    valid = None if valid is None else valid > 0  # a packed row's document ids count as tokens
    flat = x.reshape(b * s, d)
    bias = p.get("expert_bias")
    r = routing.route(flat, p["router"], moe, None if bias is None else bias.detach())
    rows = buffer_rows(moe, s, axis_size("expert"))
    # the experts on each rank's slice of their hidden width (tensor parallelism), everything
    # else read whole: a partial sum, reduced by the block's next shard()
    run = local(_routed_experts, ((None, "embed"), (None, None), (None, None), EXPERT_IN, EXPERT_IN, EXPERT_OUT,
                                  None, None, None), (None, "embed"), partial=True)
    y = run(flat, r.experts, r.weights, p["w_gate"], p["w_up"], p["w_down"], rows, b, moe.n_experts).view(b, s, d)
    if not aux_loss.in_step():  # evaluation, generation: nothing rides on the output
        return y
    load = routing.expert_counts(r.experts.view(b, s, -1), moe.n_experts, valid).sum(0)
    if bias is not None:  # the bias's "gradient": this micro batch's tokens per expert
        y = aux_loss.carry(y, bias, load)
    balancing, z = routing.balancing_loss(r, b, moe, valid), routing.z_loss(r, b, valid)
    if moe.aux_loss_coeff or moe.z_loss_coeff:
        per_sequence = moe.aux_loss_coeff * balancing + moe.z_loss_coeff * z
        y = aux_loss.attach(y, (per_sequence * routing.sequence_tokens(s, b, valid, per_sequence)).sum())
    if aux_loss.measuring(aux_loss.ROUTER_STATS):
        y = aux_loss.measure(y, _router_stats(r, load, balancing, z, rows, b, moe), aux_loss.ROUTER_STATS)
    return y


def _router_stats(r: routing.Routing, load: torch.Tensor, balancing: torch.Tensor, z: torch.Tensor, rows: int,
                  sequences: int, moe: MoE) -> torch.Tensor:
    """This layer's ``aux_loss.ROUTER_STATS`` for one micro batch (see there); the pairs
    dropped are those a capacity of ``rows`` per expert and sequence leaves out."""
    pairs = r.experts.numel()
    if rows:  # a token picks an expert once: what a sequence sends an expert beyond its rows is dropped
        sent = routing.expert_counts(r.experts.view(sequences, -1, moe.top_k), moe.n_experts)
        dropped = (sent - rows).clamp(min=0).sum()
    else:
        dropped = load.new_zeros(())
    mean = load.mean()
    one = load.new_ones(())
    return torch.stack([balancing.sum(), z.sum(), one * sequences, dropped, one * pairs, load.max() / mean,
                        load.min() / mean, one])
