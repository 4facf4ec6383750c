"""Model families. Each module exports ``Config``, ``param_specs(cfg)`` and
``forward(params, tokens, cfg)``; this package finds the module for a config and holds what
is common to all language models: the loss over a batch."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from fxmega import layers, losses, recompute
from fxmega.models import bert, gpt, llama

FAMILIES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama, "bert": bert}


def model_for(cfg: object) -> ModuleType:
    """The model module whose ``Config`` class ``cfg`` is."""
    for module in FAMILIES.values():
        if type(cfg) is module.Config:
            return module
    raise TypeError(f"{type(cfg).__name__} is not the Config of a known model family {sorted(FAMILIES)}")


def family_name(cfg: object) -> str:
    return model_for(cfg).__name__.rsplit(".", 1)[-1]


# Runs one piece of a model: ``call(piece_fn, piece_params, piece_layouts, *args, recompute=mode)``.
PieceCall = Callable[..., torch.Tensor]


def _top(names: tuple[str, ...], tree_: dict) -> dict:
    return {k: tree_[k] for k in names}


def hidden_by_pieces(model: ModuleType, params: dict, tokens: torch.Tensor, cfg: object, call: PieceCall,
                     layouts: dict, compute: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The residual stream after the last block: the embedding and each block run through
    ``call``, which may gather the piece's parameters first (ZeRO-3) and recomputes blocks
    as ``compute.recompute`` says. Each piece gets only the top-level parameter groups it
    reads (``EMBED_PARAMS``), so a gathering ``call`` gathers no more than that."""
    mode, first_n = (compute.recompute, compute.recompute_layers) if compute is not None else ("none", 0)
    x = call(model.embed, _top(model.EMBED_PARAMS, params), _top(model.EMBED_PARAMS, layouts), tokens, cfg)
    for i, (p, lay) in enumerate(zip(params["blocks"], layouts["blocks"])):
        extra = () if attention_mask is None else (attention_mask,)
        x = call(model.block, p, lay, x, cfg, *extra, recompute=recompute.mode_for_block(mode, i, first_n))
    return x


def forward_by_pieces(model: ModuleType, params: dict, tokens: torch.Tensor, cfg: object, call: PieceCall,
                      layouts: dict, compute: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``model.forward`` as its pieces (see ``hidden_by_pieces``), the head included."""
    x = hidden_by_pieces(model, params, tokens, cfg, call, layouts, compute, attention_mask)
    return call(model.head, _top(model.HEAD_PARAMS, params), _top(model.HEAD_PARAMS, layouts), x, cfg)


def head_loss_sum(model: ModuleType) -> Callable[..., torch.Tensor]:
    """A piece function ``(head_params, x, cfg, targets, loss_mask, chunk) -> summed loss``:
    the model's final norm, then the output projection and cross-entropy a chunk of tokens
    at a time (``fxmega.losses``), so the full logits never exist."""
    def run(params: dict, x: torch.Tensor, cfg: object, targets: torch.Tensor, loss_mask: torch.Tensor | None,
            chunk: int) -> torch.Tensor:
        h = model.final_hidden(params, x, cfg)
        return losses.chunked_cross_entropy_sum(h, model.output_weight(params), targets, loss_mask,
                                                cfg.vocab_size, chunk)
    return run


def mlm_loss_sum(params: dict, inputs: torch.Tensor, cfg: object, token_types: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, targets: torch.Tensor,
                 loss_mask: torch.Tensor | None) -> torch.Tensor:
    """BERT's masked-LM loss: summed cross-entropy over the masked positions."""
    hidden = bert.forward(params, inputs, cfg, token_types, attention_mask)
    return layers.cross_entropy_sum(bert.mlm_logits(params, hidden, cfg), targets, loss_mask,
                                    vocab_size=cfg.vocab_size)


def loss_by_pieces(cfg: object, compute: Any = None) -> Callable[[dict, dict, PieceCall, dict], torch.Tensor]:
    """``lm_loss_sum`` for ``cfg`` as a function of ``(params, batch, call, layouts)``: what a
    sharding runtime runs without knowing the model (``Parallel.loss_sum_fn``)."""
    def run(params: dict, batch: dict, call: PieceCall, layouts: dict) -> torch.Tensor:
        return lm_loss_sum(params, batch, cfg, call=call, layouts=layouts, compute=compute)
    return run


def lm_loss_sum(params: dict, batch: dict[str, torch.Tensor], cfg: object, call: PieceCall | None = None,
                layouts: dict | None = None, compute: Any = None) -> torch.Tensor:
    """Summed next-token cross-entropy of ``batch`` (``inputs``, ``targets``, optional
    ``loss_mask``, and ``attention_mask`` for padded batches). Callers divide by the token
    count of the whole global batch.

    With ``call`` the model runs piece by piece (see ``hidden_by_pieces``); ``compute`` (a
    ``ComputeConfig``) adds block recompute and the chunked loss (``loss_chunk``)."""
    model = model_for(cfg)
    if model is bert:  # masked LM; the whole model is one piece (one ZeRO-3 gather); no recompute
        args = (batch["inputs"], cfg, batch.get("token_types"), batch.get("attention_mask"), batch["targets"],
                batch.get("loss_mask"))
        if call is None:
            return mlm_loss_sum(params, *args)
        return call(mlm_loss_sum, params, layouts, *args)
    if call is None:
        if compute is None or (compute.recompute == "none" and not compute.loss_chunk):
            logits = model.forward(params, batch["inputs"], cfg, batch.get("attention_mask"))
            return layers.cross_entropy_sum(logits, batch["targets"], batch.get("loss_mask"),
                                            vocab_size=cfg.vocab_size)
        call, layouts = recompute.plain_call, params
    x = hidden_by_pieces(model, params, batch["inputs"], cfg, call, layouts, compute, batch.get("attention_mask"))
    head_params, head_layouts = _top(model.HEAD_PARAMS, params), _top(model.HEAD_PARAMS, layouts)
    if compute is not None and compute.loss_chunk:
        return call(head_loss_sum(model), head_params, head_layouts, x, cfg, batch["targets"],
                    batch.get("loss_mask"), compute.loss_chunk)
    logits = call(model.head, head_params, head_layouts, x, cfg)
    return layers.cross_entropy_sum(logits, batch["targets"], batch.get("loss_mask"), vocab_size=cfg.vocab_size)
