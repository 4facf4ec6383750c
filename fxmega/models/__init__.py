"""Model families. Each module exports ``Config``, ``param_specs(cfg)`` and
``forward(params, tokens, cfg)``; this package finds the module for a config and holds what
is common to all language models: the loss over a batch."""

from __future__ import annotations

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


def lm_loss_sum(params: dict, batch: dict[str, torch.Tensor], cfg: object) -> torch.Tensor:
    """Summed next-token cross-entropy of ``batch`` (``inputs``, ``targets``, optional
    ``loss_mask``). Callers divide by the token count of the whole global batch."""
    logits = model_for(cfg).forward(params, batch["inputs"], cfg)
    return layers.cross_entropy_sum(logits, batch["targets"], batch.get("loss_mask"))
