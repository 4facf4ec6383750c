"""A family's backbone with a sequence-classification head, as a model family of its own.

``classifier(family, cfg, n_classes)`` has the family's embedding and blocks and, as its
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

import dataclasses

import torch

from fxmega.core import tree
from fxmega.core.errors import ConfigError
from fxmega.core.spec import ZEROS, ParamSpec, normal
from fxmega.models.family import ModelConfig, ModelFamily, no_stats
from fxmega.ops import layers, objectives
from fxmega.sharding import layout


def classifier_specs(cfg: ModelConfig, n_classes: int, init_std: float) -> dict:
    """The head ``pooled @ w + b``. ``classes`` is in no sharding rule, so it stays whole;
    ``embed`` is treated like every other weight's (FSDP/ZeRO may split it)."""
    d = cfg.d_model
    return {"classifier": {"w": ParamSpec((d, n_classes), ("embed", "classes"), normal(init_std)),
                           "b": ParamSpec((n_classes,), ("classes",), ZEROS)}}


OUTPUT_AXES = ("batch", "classes")


def classifier(family: ModelFamily, cfg: ModelConfig, n_classes: int) -> ModelFamily:
    """``family`` with a classification head over ``n_classes`` (see the module docstring):
    a ``ModelFamily`` of its own, named ``<family>-classifier``, not registered (its configs
    are the backbone's)."""
    if family.pool is None:
        raise ConfigError(f"the {family.name} family declares no pool (what a classification head is put on): "
                          f"give its ModelFamily pool= and POOL_PARAMS=")
    backbone = family.param_specs(cfg)
    pools = tuple(g for g in family.POOL_PARAMS if g in backbone)
    # the family's LM head (Llama's ``head``, BERT's ``mlm``) is left out: a parameter
    # outside the loss has no gradient, which ``torch.autograd.grad`` in the step refuses
    keep = (*family.EMBED_PARAMS, "blocks", *pools)
    specs = {**{k: v for k, v in backbone.items() if k in keep}, **classifier_specs(cfg, n_classes, cfg.init_std)}
    head_groups = (*pools, "classifier")
    head_specs = {g: specs[g] for g in head_groups}
    head_axes = tuple(s.axes for s in tree.leaves(head_specs))
    pool = family.pool

    def head(params: dict, x: torch.Tensor, cfg: ModelConfig, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, n_classes]`` in fp32 from the final hidden states ``x``."""
        def on_local(x: torch.Tensor, valid: torch.Tensor | None, *leaves: torch.Tensor) -> torch.Tensor:
            with layout.activate(None):  # plain tensors here: the head's math, no layouts
                p = tree.unflatten_like(head_specs, list(leaves))
                w = p["classifier"]
                return layers.linear(pool(p, x, valid, cfg), w["w"], w["b"], role="head").float()

        in_axes = (("batch", "ctx", "embed"), None if valid is None else ("batch", "ctx"), *head_axes)
        return layout.local(on_local, in_axes, OUTPUT_AXES)(x, valid, *tree.leaves(params))

    # the blocks' per-step inputs (attend_inputs) are built once, as the family's are
    return dataclasses.replace(
        family, name=f"{family.name}-classifier", param_specs=lambda cfg: specs, head=head,
        objective=lambda cfg: objectives.classification(n_classes),
        eval_objective=lambda cfg: objectives.classification_eval(n_classes),  # the loss and the right answers
        HEAD_PARAMS=head_groups, HEAD_INPUTS=("attention_mask",), OUTPUT_AXES=OUTPUT_AXES,
        # a classifier is not a language model: no chunked vocabulary loss, no decoding, no pooling of its own
        final_hidden=None, output_weight=None, kv_cache_shape=None, decode_write=None, POOL_PARAMS=(), pool=None,
        # the head finds each row's last real token in order: not on out-of-order cp chunks
        CONTEXT_PARALLEL=False,
        # its head is its own (no multi-token prediction); it reports no statistics
        head_groups_of=None, meter_stats=no_stats)
