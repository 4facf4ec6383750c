"""A model summary from specs alone: parameters per group and block, FLOPs per token, and a
shape check that runs the forward pass on meta tensors (no memory is allocated)."""

from __future__ import annotations

import math

import torch

from fxmega.core import tree
from fxmega.models import family_name, model_for, pieces
from fxmega.ops import recompute
from fxmega.ops.init import count_params, meta_params
from fxmega.training.metrics import model_flops_per_token


def check_shapes(model_cfg: object, seq_len: int, batch: int = 1) -> tuple[int, ...]:
    """Run the forward pass, piece by piece as every step does, on the meta device; returns
    the logits shape."""
    model = model_for(model_cfg)
    params = meta_params(model.param_specs(model_cfg))
    if model.example_batch is not None:  # a family whose batches are more than tokens (T5)
        inputs = model.example_batch(model_cfg, batch, "meta")
    else:
        inputs = {"inputs": torch.zeros(batch, seq_len, dtype=torch.long, device="meta")}
    logits = pieces.run_pieces(model, params, params, inputs["inputs"], model_cfg, recompute.plain_call,
                               inputs=pieces.embed_inputs(model, inputs))
    expected = (batch, inputs.get("targets", inputs["inputs"]).shape[1], model_cfg.vocab_size)
    if tuple(logits.shape) != expected:
        raise AssertionError(f"forward returned logits of shape {tuple(logits.shape)}, expected {expected}")
    return tuple(logits.shape)


def _runs_of_alike_blocks(blocks: list[dict]) -> list[tuple[int, int]]:
    """``(first, last)`` of each run of consecutive blocks with the same parameter shapes (all
    of them, or e.g. DeepSeek-MoE's dense first block and its expert blocks)."""
    def shape_of(b: dict) -> list:
        return [(p, s.shape) for p, s in tree.items(b)]

    runs: list[tuple[int, int]] = []
    for i, b in enumerate(blocks):
        if runs and shape_of(blocks[runs[-1][0]]) == shape_of(b):
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def summary(model_cfg: object, seq_len: int) -> str:
    specs = model_for(model_cfg).param_specs(model_cfg)
    rows: list[tuple[str, int, str]] = []
    for key, sub in specs.items():
        if isinstance(sub, list):  # the blocks, DeepSeek-V3's MTP modules
            for first, last in _runs_of_alike_blocks(sub):
                per_block = count_params(sub[first])
                which = key if (first, last) == (0, len(sub) - 1) else f"{key} {first}-{last}"
                rows.append((f"{which} ({last - first + 1} x {per_block:,})", per_block * (last - first + 1), ""))
                for name, part in sub[first].items():
                    shapes = ", ".join(f"{p.split('.', 1)[-1]} {list(s.shape)}" for p, s in tree.items({name: part})
                                       if len(s.shape) > 1)
                    rows.append((f"  {name}", count_params(part), shapes))
        else:
            shapes = ", ".join(f"{list(s.shape)} {s.axes}" for s in tree.leaves(sub))
            rows.append((key, count_params(sub), shapes))
    logits = check_shapes(model_cfg, seq_len)
    total = count_params(specs)
    flops = model_flops_per_token(specs, model_cfg, seq_len)
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{family_name(model_cfg)} model: d_model={model_cfg.d_model}, n_layers={model_cfg.n_layers}, "
             f"n_heads={model_cfg.n_heads}, vocab_size={model_cfg.vocab_size}"]
    lines += [f"  {name:<{width}}{n:>15,}  {shapes}".rstrip() for name, n, shapes in rows]
    lines.append(f"parameters: {total:,}")
    if "mtp" in specs:  # trained beside the main model, not used to generate
        lines.append(f"  multi-token prediction modules: {count_params(specs['mtp']):,}; the main model: "
                     f"{total - count_params(specs['mtp']):,}")
    active = model_for(model_cfg).active_params
    if active is not None:  # a mixture of experts: what one token passes through
        lines.append(f"active per token: {active(model_cfg):,}")
    lines.append(f"FLOPs/token at seq_len {seq_len}: {flops:,} (6N + 12*L*H*Q*T; N without position embeddings)")
    model = model_for(model_cfg)
    if model.can_decode and not model.is_encoder_decoder:  # what generation caches for each token
        per_block = [math.prod(shape[2:]) for shape in pieces.cache_shapes(model, model_cfg, 1, 1)]
        lines.append(f"KV cache per token: {model_cfg.n_layers * sum(per_block) * 2:,} bytes in bf16 "
                     f"({model_cfg.n_layers} blocks x {' + '.join(map(str, per_block))} values)")
    lines.append(f"shape check on meta tensors: logits {list(logits)} ok")
    return "\n".join(lines)
