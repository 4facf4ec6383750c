"""Model families. Each module exports ``Config``, ``param_specs(cfg)`` and
``forward(params, tokens, cfg)``; this package finds the module for a config and holds what
is common to all language models: the loss over a batch."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from fxmega import layers
from fxmega.models import gpt, llama

FAMILIES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama}


def model_for(cfg: object) -> ModuleType:
    """The model module whose ``Config`` class ``cfg`` is."""
    for module in FAMILIES.values():
        if type(cfg) is module.Config:
            return module
    raise TypeError(f"{type(cfg).__name__} is not the Config of a known model family {sorted(FAMILIES)}")


def family_name(cfg: object) -> str:
    return model_for(cfg).__name__.rsplit(".", 1)[-1]


# Runs one piece of a model: ``call(piece_fn, piece_params, piece_layouts, *args)``.
PieceCall = Callable[..., torch.Tensor]


def forward_by_pieces(model: ModuleType, params: dict, tokens: torch.Tensor, cfg: object, call: PieceCall,
                      layouts: dict) -> torch.Tensor:
    """``model.forward`` as its pieces — embedding, each block, head — each run through
    ``call``, which may gather the piece's parameters first (ZeRO-3) or recompute it. Each
    piece gets only the top-level parameter groups it reads (``EMBED_PARAMS``,
    ``HEAD_PARAMS``), so a gathering ``call`` gathers no more than that."""
    def top(names: tuple[str, ...], tree_: dict) -> dict:
        return {k: tree_[k] for k in names}

    x = call(model.embed, top(model.EMBED_PARAMS, params), top(model.EMBED_PARAMS, layouts), tokens, cfg)
    for p, lay in zip(params["blocks"], layouts["blocks"]):
        x = call(model.block, p, lay, x, cfg)
    return call(model.head, top(model.HEAD_PARAMS, params), top(model.HEAD_PARAMS, layouts), x, cfg)


def lm_loss_sum(params: dict, batch: dict[str, torch.Tensor], cfg: object, call: PieceCall | None = None,
                layouts: dict | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of ``batch`` (``inputs``, ``targets``, optional
    ``loss_mask``). Callers divide by the token count of the whole global batch. With
    ``call``, the model runs piece by piece (see ``forward_by_pieces``)."""
    model = model_for(cfg)
    if call is None:
        logits = model.forward(params, batch["inputs"], cfg)
    else:
        logits = forward_by_pieces(model, params, batch["inputs"], cfg, call, layouts)
    return layers.cross_entropy_sum(logits, batch["targets"], batch.get("loss_mask"), vocab_size=cfg.vocab_size)
