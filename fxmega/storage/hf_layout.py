"""Hugging Face ``transformers`` weight layouts ⇄ fxmega parameter trees, for GPT-2, Llama and
Mixtral.

Only the renaming and reshaping of tensors lives here (no file I/O): GPT-2's Conv1D weights
are already ``[in, out]`` like ours; Llama's ``nn.Linear`` weights are ``[out, in]`` and are
transposed. Heads become their own dim. Both directions are exact inverses.
"""

from __future__ import annotations

import torch

from fxmega.models import deepseek_v3, gpt, llama, mixtral


def gpt2_from_hf(sd: dict[str, torch.Tensor], cfg: gpt.Config) -> dict:
    """fxmega GPT params from a ``GPT2LMHeadModel`` / ``GPT2Model`` state dict."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.head_dim

    def norm(name: str) -> dict:
        return {"scale": sd[f"{name}.weight"], "bias": sd[f"{name}.bias"]}

    blocks = []
    for i in range(cfg.n_layers):
        p = f"h.{i}"
        blocks.append({
            "attn_norm": norm(f"{p}.ln_1"),
            "attn": {
                "wqkv": sd[f"{p}.attn.c_attn.weight"].reshape(d, 3, h, hd),
                "bqkv": sd[f"{p}.attn.c_attn.bias"].reshape(3, h, hd),
                "wo": sd[f"{p}.attn.c_proj.weight"].reshape(h, hd, d),
                "bo": sd[f"{p}.attn.c_proj.bias"],
            },
            "mlp_norm": norm(f"{p}.ln_2"),
            "mlp": {
                "w_in": sd[f"{p}.mlp.c_fc.weight"], "b_in": sd[f"{p}.mlp.c_fc.bias"],
                "w_out": sd[f"{p}.mlp.c_proj.weight"], "b_out": sd[f"{p}.mlp.c_proj.bias"],
            },
        })
    return {
        "embed": {"tokens": sd["wte.weight"], "positions": sd["wpe.weight"]},
        "blocks": blocks,
        "final_norm": norm("ln_f"),
    }


def gpt2_to_hf(params: dict, cfg: gpt.Config) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict from fxmega GPT params (head tied to ``wte``)."""
    d = cfg.d_model
    sd = {
        "transformer.wte.weight": params["embed"]["tokens"],
        "transformer.wpe.weight": params["embed"]["positions"],
        "transformer.ln_f.weight": params["final_norm"]["scale"],
        "transformer.ln_f.bias": params["final_norm"]["bias"],
        "lm_head.weight": params["embed"]["tokens"],
    }
    for i, b in enumerate(params["blocks"]):
        p = f"transformer.h.{i}"
        sd |= {
            f"{p}.ln_1.weight": b["attn_norm"]["scale"], f"{p}.ln_1.bias": b["attn_norm"]["bias"],
            f"{p}.attn.c_attn.weight": b["attn"]["wqkv"].reshape(d, 3 * d),
            f"{p}.attn.c_attn.bias": b["attn"]["bqkv"].reshape(3 * d),
            f"{p}.attn.c_proj.weight": b["attn"]["wo"].reshape(d, d),
            f"{p}.attn.c_proj.bias": b["attn"]["bo"],
            f"{p}.ln_2.weight": b["mlp_norm"]["scale"], f"{p}.ln_2.bias": b["mlp_norm"]["bias"],
            f"{p}.mlp.c_fc.weight": b["mlp"]["w_in"], f"{p}.mlp.c_fc.bias": b["mlp"]["b_in"],
            f"{p}.mlp.c_proj.weight": b["mlp"]["w_out"], f"{p}.mlp.c_proj.bias": b["mlp"]["b_out"],
        }
    return sd


def _llama_block_from_hf(sd: dict[str, torch.Tensor], p: str, cfg: llama.Config) -> dict:
    """A Llama block's norms and attention from the tensors under prefix ``p``."""
    attn = _llama_attn(sd, p, cfg)
    if cfg.qk_norm:  # Qwen3
        attn |= {"q_norm": {"scale": sd[f"{p}.self_attn.q_norm.weight"]},
                 "k_norm": {"scale": sd[f"{p}.self_attn.k_norm.weight"]}}
    return {
        "attn_norm": {"scale": sd[f"{p}.input_layernorm.weight"]},
        "attn": attn,
        "mlp_norm": {"scale": sd[f"{p}.post_attention_layernorm.weight"]},
    }


def _llama_attn(sd: dict[str, torch.Tensor], p: str, cfg: llama.Config) -> dict:
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    biases = {}
    if cfg.qkv_bias:  # Qwen2-MoE
        biases = {"bq": sd[f"{p}.self_attn.q_proj.bias"].reshape(h, hd),
                  "bk": sd[f"{p}.self_attn.k_proj.bias"].reshape(kv, hd),
                  "bv": sd[f"{p}.self_attn.v_proj.bias"].reshape(kv, hd)}
    return {
        "wq": sd[f"{p}.self_attn.q_proj.weight"].t().reshape(d, h, hd),
        "wk": sd[f"{p}.self_attn.k_proj.weight"].t().reshape(d, kv, hd),
        "wv": sd[f"{p}.self_attn.v_proj.weight"].t().reshape(d, kv, hd),
        "wo": sd[f"{p}.self_attn.o_proj.weight"].t().reshape(h, hd, d),
        **biases,
    }


def _llama_outer_from_hf(sd: dict[str, torch.Tensor], blocks: list[dict]) -> dict:
    return {
        "embed": {"tokens": sd["model.embed_tokens.weight"]},
        "blocks": blocks,
        "final_norm": {"scale": sd["model.norm.weight"]},
        "head": sd["lm_head.weight"].t(),
    }


def llama_from_hf(sd: dict[str, torch.Tensor], cfg: llama.Config) -> dict:
    """fxmega Llama params from a ``LlamaForCausalLM`` state dict."""
    blocks = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        blocks.append(_llama_block_from_hf(sd, p, cfg) | _dense_mlp_from_hf(sd, p))
    return _llama_outer_from_hf(sd, blocks)


def mixtral_from_hf(sd: dict[str, torch.Tensor], cfg: mixtral.Config) -> dict:
    """fxmega Mixtral params from a ``MixtralForCausalLM`` checkpoint as the Hub and
    ``save_pretrained`` store it: per expert ``w1`` (gate), ``w3`` (up) ``[f, d]`` and ``w2``
    (down) ``[d, f]``, the router ``gate [E, d]``."""
    blocks = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        moe = f"{p}.block_sparse_moe"
        blocks.append(_llama_block_from_hf(sd, p, cfg) | _moe_from_hf(sd, f"{moe}.experts", f"{moe}.gate.weight",
                                                                      MIXTRAL_EXPERT, cfg.moe.n_experts))
    return _llama_outer_from_hf(sd, blocks)


# the Hub's names of each expert's gate, up and down projections
MIXTRAL_EXPERT = ("w1", "w3", "w2")
QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")


def _moe_from_hf(sd: dict[str, torch.Tensor], experts: str, router: str, names: tuple[str, str, str],
                 n_experts: int) -> dict:
    """A MoE layer from per-expert ``{experts}.{e}.{name}.weight`` tensors (``[f, d]``, the
    down projection ``[d, f]``) and the router ``[E, d]``, stacked along the expert dim."""
    gate, up, down = (torch.stack([sd[f"{experts}.{e}.{n}.weight"].t() for e in range(n_experts)]) for n in names)
    return {"moe": {"router": sd[router].t(), "w_gate": gate, "w_up": up, "w_down": down}}


def _moe_to_hf(m: dict, experts: str, router: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The inverse of ``_moe_from_hf``."""
    out = {router: m["router"].t()}
    for e in range(m["w_gate"].shape[0]):
        out |= {f"{experts}.{e}.{n}.weight": m[w][e].t() for n, w in zip(names, ("w_gate", "w_up", "w_down"))}
    return out


def _llama_block_to_hf(b: dict, p: str, d: int) -> dict[str, torch.Tensor]:
    a = b["attn"]
    norms = {f"{p}.self_attn.{n}.weight": a[n]["scale"] for n in ("q_norm", "k_norm") if n in a}
    norms |= {f"{p}.self_attn.{n}_proj.bias": a[f"b{n}"].reshape(-1) for n in "qkv" if f"b{n}" in a}
    return norms | {
        f"{p}.input_layernorm.weight": b["attn_norm"]["scale"],
        f"{p}.post_attention_layernorm.weight": b["mlp_norm"]["scale"],
        f"{p}.self_attn.q_proj.weight": a["wq"].reshape(d, -1).t(),
        f"{p}.self_attn.k_proj.weight": a["wk"].reshape(d, -1).t(),
        f"{p}.self_attn.v_proj.weight": a["wv"].reshape(d, -1).t(),
        f"{p}.self_attn.o_proj.weight": a["wo"].reshape(-1, d).t(),
    }


def _llama_outer_to_hf(params: dict) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": params["embed"]["tokens"],
        "model.norm.weight": params["final_norm"]["scale"],
        "lm_head.weight": params["head"].t(),
    }


def llama_to_hf(params: dict, cfg: llama.Config) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict from fxmega Llama params."""
    sd = _llama_outer_to_hf(params)
    for i, b in enumerate(params["blocks"]):
        p = f"model.layers.{i}"
        sd |= _llama_block_to_hf(b, p, cfg.d_model) | _dense_mlp_to_hf(b["mlp"], p)
    return {k: v.contiguous() for k, v in sd.items()}


def mixtral_to_hf(params: dict, cfg: mixtral.Config) -> dict[str, torch.Tensor]:
    """A ``MixtralForCausalLM`` checkpoint (the Hub's per-expert layout) from fxmega params."""
    sd = _llama_outer_to_hf(params)
    for i, b in enumerate(params["blocks"]):
        p = f"model.layers.{i}"
        moe = f"{p}.block_sparse_moe"
        sd |= _llama_block_to_hf(b, p, cfg.d_model) | _moe_to_hf(b["moe"], f"{moe}.experts", f"{moe}.gate.weight",
                                                                 MIXTRAL_EXPERT)
    return {k: v.contiguous() for k, v in sd.items()}


def _dense_mlp_from_hf(sd: dict[str, torch.Tensor], p: str, under: str = ".mlp") -> dict:
    """A SwiGLU MLP from ``{p}{under}.{gate,up,down}_proj.weight``."""
    return {"mlp": {"w_gate": sd[f"{p}{under}.gate_proj.weight"].t(), "w_up": sd[f"{p}{under}.up_proj.weight"].t(),
                    "w_down": sd[f"{p}{under}.down_proj.weight"].t()}}


def _dense_mlp_to_hf(m: dict, p: str, under: str = ".mlp") -> dict[str, torch.Tensor]:
    return {f"{p}{under}.gate_proj.weight": m["w_gate"].t(), f"{p}{under}.up_proj.weight": m["w_up"].t(),
            f"{p}{under}.down_proj.weight": m["w_down"].t()}


def qwen_moe_from_hf(sd: dict[str, torch.Tensor], cfg: mixtral.Config) -> dict:
    """fxmega params (the mixtral family) from a ``Qwen3MoeForCausalLM`` or
    ``Qwen2MoeForCausalLM`` checkpoint: per expert ``gate_proj``, ``up_proj`` ``[f, d]`` and
    ``down_proj`` ``[d, f]`` under ``mlp.experts``, the router ``mlp.gate [E, d]``; Qwen2-MoE's
    shared experts as one MLP ``mlp.shared_expert`` with its gate ``mlp.shared_expert_gate
    [1, d]``; the first ``first_dense_layers`` (Qwen's ``mlp_only_layers``) a dense ``mlp``."""
    blocks = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        if not cfg.moe.is_moe_layer(i):
            blocks.append(_llama_block_from_hf(sd, p, cfg) | _dense_mlp_from_hf(sd, p))
            continue
        block = _llama_block_from_hf(sd, p, cfg) | _moe_from_hf(sd, f"{p}.mlp.experts", f"{p}.mlp.gate.weight",
                                                                QWEN_EXPERT, cfg.moe.n_experts)
        if cfg.moe.n_shared_experts:
            block["moe"]["shared"] = _dense_mlp_from_hf(sd, f"{p}.mlp.shared_expert", "")["mlp"]
            block["moe"]["shared_gate"] = sd[f"{p}.mlp.shared_expert_gate.weight"].t()
        blocks.append(block)
    return _llama_outer_from_hf(sd, blocks)


def qwen_moe_to_hf(params: dict, cfg: mixtral.Config) -> dict[str, torch.Tensor]:
    """A ``Qwen3MoeForCausalLM`` or ``Qwen2MoeForCausalLM`` checkpoint (the Hub's per-expert
    layout) from fxmega params: the inverse of ``qwen_moe_from_hf``."""
    sd = _llama_outer_to_hf(params)
    for i, b in enumerate(params["blocks"]):
        p = f"model.layers.{i}"
        sd |= _llama_block_to_hf(b, p, cfg.d_model)
        if "mlp" in b:
            sd |= _dense_mlp_to_hf(b["mlp"], p)
            continue
        sd |= _moe_to_hf(b["moe"], f"{p}.mlp.experts", f"{p}.mlp.gate.weight", QWEN_EXPERT)
        if "shared" in b["moe"]:
            sd |= _dense_mlp_to_hf(b["moe"]["shared"], f"{p}.mlp.shared_expert", "")
            sd[f"{p}.mlp.shared_expert_gate.weight"] = b["moe"]["shared_gate"].t()
    return {k: v.contiguous() for k, v in sd.items()}


def rope_pairs_to_halves(n: int) -> torch.Tensor:
    """The order that takes ``n`` rotary dims laid out in interleaved pairs ``(x0, x1), (x2,
    x3), ...`` (DeepSeek's checkpoints, transformers' ``rope_interleave``) to rotate-half's
    first halves then second halves (fxmega's): even dims, then odd ones. A query's and its
    key's rotary dims permuted alike leave every score unchanged."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _reorder_rope(w: torch.Tensor, rope: int, order: torch.Tensor) -> torch.Tensor:
    """``w`` with its last dim's final ``rope`` entries (the rotary ones) taken in ``order``."""
    return torch.cat([w[..., :-rope], w[..., -rope:][..., order]], dim=-1)


def _mla_from_hf(sd: dict[str, torch.Tensor], p: str, cfg: deepseek_v3.Config, interleaved: bool) -> dict:
    """MLA's parameters from ``{p}.self_attn.*`` (``nn.Linear`` weights, ``[out, in]``)."""
    h, rope = cfg.n_heads, cfg.qk_rope_head_dim
    order = rope_pairs_to_halves(rope) if interleaved else torch.arange(rope)
    a = f"{p}.self_attn"

    def heads(name: str, width: int) -> torch.Tensor:  # [in, heads, width], the rotary dims in fxmega's order
        w = sd[f"{a}.{name}.weight"].t()
        return w.reshape(w.shape[0], h, width)

    if cfg.q_lora_rank:
        queries = {"wq_a": sd[f"{a}.q_a_proj.weight"].t(), "q_norm": {"scale": sd[f"{a}.q_a_layernorm.weight"]},
                   "wq_b": _reorder_rope(heads("q_b_proj", cfg.qk_head_dim), rope, order)}
    else:
        queries = {"wq": _reorder_rope(heads("q_proj", cfg.qk_head_dim), rope, order)}
    return {**queries,
            "wkv_a": _reorder_rope(sd[f"{a}.kv_a_proj_with_mqa.weight"].t(), rope, order),
            "kv_norm": {"scale": sd[f"{a}.kv_a_layernorm.weight"]},
            "wkv_b": heads("kv_b_proj", cfg.qk_nope_head_dim + cfg.v_head_dim),
            "wo": sd[f"{a}.o_proj.weight"].t().reshape(h, cfg.v_head_dim, cfg.d_model)}


def _mla_to_hf(a: dict, p: str, cfg: deepseek_v3.Config) -> dict[str, torch.Tensor]:
    """The inverse of ``_mla_from_hf``, written interleaved (as DeepSeek's checkpoints are)."""
    rope = cfg.qk_rope_head_dim
    back = torch.argsort(rope_pairs_to_halves(rope))
    s = f"{p}.self_attn"

    def flat(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], -1).t()

    if "wq_a" in a:
        out = {f"{s}.q_a_proj.weight": a["wq_a"].t(), f"{s}.q_a_layernorm.weight": a["q_norm"]["scale"],
               f"{s}.q_b_proj.weight": flat(_reorder_rope(a["wq_b"], rope, back))}
    else:
        out = {f"{s}.q_proj.weight": flat(_reorder_rope(a["wq"], rope, back))}
    return out | {f"{s}.kv_a_proj_with_mqa.weight": _reorder_rope(a["wkv_a"], rope, back).t(),
                  f"{s}.kv_a_layernorm.weight": a["kv_norm"]["scale"],
                  f"{s}.kv_b_proj.weight": flat(a["wkv_b"]),
                  f"{s}.o_proj.weight": a["wo"].reshape(-1, cfg.d_model).t()}


def deepseek_v3_from_hf(sd: dict[str, torch.Tensor], cfg: deepseek_v3.Config, interleaved: bool = True) -> dict:
    """fxmega DeepSeek-V3 params from a ``DeepseekV3ForCausalLM`` checkpoint as the Hub and
    ``save_pretrained`` store it: MLA's projections (the rotary dims ``interleaved`` unless
    the config says ``rope_interleave: false``), the first ``first_k_dense_replace`` blocks'
    dense ``mlp``, then per expert ``gate_proj``, ``up_proj``, ``down_proj`` under
    ``mlp.experts``, the router ``mlp.gate`` with its ``e_score_correction_bias`` (the
    auxiliary-loss-free selection bias) and the shared experts as one MLP. With
    ``cfg.mtp_depth`` the multi-token prediction modules too, as DeepSeek's released
    checkpoint stores them (transformers drops them on load): layer ``n_layers + k`` holds
    module ``k``'s block beside ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
    (its ``embed_tokens`` and ``shared_head.head`` are copies of the main model's)."""
    params = _llama_outer_from_hf(sd, [_deepseek_v3_block_from_hf(sd, i, cfg, interleaved)
                                       for i in range(cfg.n_layers)])
    if cfg.mtp_depth:
        params["mtp"] = []
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
            p = f"model.layers.{i}"
            params["mtp"].append({"enorm": {"scale": sd[f"{p}.enorm.weight"]},
                                  "hnorm": {"scale": sd[f"{p}.hnorm.weight"]}, "eh_proj": sd[f"{p}.eh_proj.weight"].t(),
                                  "block": _deepseek_v3_block_from_hf(sd, i, cfg, interleaved),
                                  "norm": {"scale": sd[f"{p}.shared_head.norm.weight"]}})
    return params


def _deepseek_v3_block_from_hf(sd: dict[str, torch.Tensor], i: int, cfg: deepseek_v3.Config,
                               interleaved: bool) -> dict:
    p = f"model.layers.{i}"
    block = {"attn_norm": {"scale": sd[f"{p}.input_layernorm.weight"]}, "attn": _mla_from_hf(sd, p, cfg, interleaved),
             "mlp_norm": {"scale": sd[f"{p}.post_attention_layernorm.weight"]}}
    if not cfg.moe.is_moe_layer(i):
        return block | _dense_mlp_from_hf(sd, p)
    block |= _moe_from_hf(sd, f"{p}.mlp.experts", f"{p}.mlp.gate.weight", QWEN_EXPERT, cfg.moe.n_experts)
    block["moe"]["expert_bias"] = sd[f"{p}.mlp.gate.e_score_correction_bias"]
    if cfg.moe.n_shared_experts:
        block["moe"]["shared"] = _dense_mlp_from_hf(sd, f"{p}.mlp.shared_experts", "")["mlp"]
    return block


def deepseek_v3_to_hf(params: dict, cfg: deepseek_v3.Config) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` checkpoint (the Hub's per-expert layout, rotary dims
    interleaved) from fxmega params: the inverse of ``deepseek_v3_from_hf``, the MTP modules
    written as DeepSeek's release writes them (with their copies of the embedding and head)."""
    sd = _llama_outer_to_hf(params)
    for i, b in enumerate(params["blocks"]):
        sd |= _deepseek_v3_block_to_hf(b, f"model.layers.{i}", cfg)
    for i, m in enumerate(params.get("mtp", []), start=cfg.n_layers):
        p = f"model.layers.{i}"
        sd |= _deepseek_v3_block_to_hf(m["block"], p, cfg) | {
            f"{p}.enorm.weight": m["enorm"]["scale"], f"{p}.hnorm.weight": m["hnorm"]["scale"],
            f"{p}.eh_proj.weight": m["eh_proj"].t(), f"{p}.shared_head.norm.weight": m["norm"]["scale"],
            # copies, not aliases (safetensors stores no tensor twice)
            f"{p}.embed_tokens.weight": params["embed"]["tokens"].clone(),
            f"{p}.shared_head.head.weight": params["head"].t().clone()}
    return {k: v.contiguous() for k, v in sd.items()}


def _deepseek_v3_block_to_hf(b: dict, p: str, cfg: deepseek_v3.Config) -> dict[str, torch.Tensor]:
    sd = {f"{p}.input_layernorm.weight": b["attn_norm"]["scale"],
          f"{p}.post_attention_layernorm.weight": b["mlp_norm"]["scale"]} | _mla_to_hf(b["attn"], p, cfg)
    if "mlp" in b:
        return sd | _dense_mlp_to_hf(b["mlp"], p)
    m = b["moe"]
    sd |= _moe_to_hf(m, f"{p}.mlp.experts", f"{p}.mlp.gate.weight", QWEN_EXPERT)
    sd[f"{p}.mlp.gate.e_score_correction_bias"] = m["expert_bias"] if "expert_bias" in m else \
        torch.zeros(cfg.moe.n_experts, dtype=m["router"].dtype)
    if "shared" in m:
        sd |= _dense_mlp_to_hf(m["shared"], f"{p}.mlp.shared_experts", "")
    return sd
