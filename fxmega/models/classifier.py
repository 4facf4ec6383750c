"""A family's backbone with a sequence-classification head, as a model family of its own.

``Classifier(family, cfg, n_classes)`` has the family's embedding and blocks and, as its
head, the family's ``pool`` (BERT: the pooler or [CLS]; GPT and Llama: the last real
token after the final norm) and a linear classifier ``[embed, classes]``. Its objective is
cross-entropy over the classes. Because it is a family like any other, fine-tuning runs
through the same pieces, step, sharding runtime and pipeline as pre-training: nothing
downstream knows it is a classifier.

The head reads the attention mask (``HEAD_INPUTS``) to find each row's last real token,
and runs on each rank's local tensors: its ``classes`` axis is a name no rule splits, so
under tensor parallelism the pooled vector, the classifier and the logits are replicated
and every tp rank computes the same logits (``OUTPUT_AXES``).
"""

from __future__ import annotations

from typing import Any

import torch

from fxmega.core import tree
from fxmega.core.spec import ZEROS, ParamSpec, normal
from fxmega.models.registry import ModelConfig, ModelFamily
from fxmega.ops import layers, objectives
from fxmega.sharding import layout


def classifier_specs(cfg: ModelConfig, n_classes: int, init_std: float) -> dict:
    """The head ``pooled @ w + b``. ``classes`` is in no sharding rule, so it stays whole;
    ``embed`` is treated like every other weight's (FSDP/ZeRO may split it)."""
    d = cfg.d_model
    return {"classifier": {"w": ParamSpec((d, n_classes), ("embed", "classes"), normal(init_std)),
                           "b": ParamSpec((n_classes,), ("classes",), ZEROS)}}


class Classifier:
    """``family`` with a classification head over ``n_classes`` (see the module docstring);
    implements ``ModelFamily``."""

    HEAD_INPUTS = ("attention_mask",)
    OUTPUT_AXES = ("batch", "classes")

    def __init__(self, family: ModelFamily, cfg: ModelConfig, n_classes: int) -> None:
        self.family, self.n_classes = family, n_classes
        self.Config = family.Config
        self.EMBED_PARAMS = family.EMBED_PARAMS
        self.EMBED_INPUTS = family.EMBED_INPUTS
        self.embed, self.block = family.embed, family.block
        if hasattr(family, "attend_inputs"):  # the blocks' per-step inputs, built once as the family's are
            self.attend_inputs = family.attend_inputs
        backbone = family.param_specs(cfg)
        pools = tuple(g for g in family.POOL_PARAMS if g in backbone)
        # the family's LM head (Llama's ``head``, BERT's ``mlm``) is left out: a parameter
        # outside the loss has no gradient, which ``torch.autograd.grad`` in the step refuses
        keep = (*family.EMBED_PARAMS, "blocks", *pools)
        self._specs = {**{k: v for k, v in backbone.items() if k in keep},
                       **classifier_specs(cfg, n_classes, cfg.init_std)}
        self.HEAD_PARAMS = (*pools, "classifier")
        self._head_specs = {g: self._specs[g] for g in self.HEAD_PARAMS}
        self._head_axes = tuple(s.axes for s in tree.leaves(self._head_specs))

    def param_specs(self, cfg: ModelConfig) -> dict:
        return self._specs

    def head(self, params: dict, x: torch.Tensor, cfg: ModelConfig, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, n_classes]`` in fp32 from the final hidden states ``x``."""
        def on_local(x: torch.Tensor, valid: torch.Tensor | None, *leaves: torch.Tensor) -> torch.Tensor:
            with layout.activate(None):  # plain tensors here: the head's math, no layouts
                p = tree.unflatten_like(self._head_specs, list(leaves))
                w = p["classifier"]
                return layers.linear(self.family.pool(p, x, valid, cfg), w["w"], w["b"]).float()

        in_axes = (("batch", "ctx", "embed"), None if valid is None else ("batch", "ctx"), *self._head_axes)
        return layout.local(on_local, in_axes, self.OUTPUT_AXES)(x, valid, *tree.leaves(params))

    def objective(self, cfg: Any = None) -> objectives.CrossEntropy:
        return objectives.classification(self.n_classes)

    def eval_objective(self) -> objectives.LossAndCorrect:
        """The loss and the number of right answers, from the same logits."""
        return objectives.classification_eval(self.n_classes)
