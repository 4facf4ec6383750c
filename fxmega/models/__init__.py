"""Model families. Each registers by name (``fxmega.models.registry``) and exports its
``Config``, ``param_specs(cfg)``, its pieces (``embed``, ``block``, ``head``) and its
objective; this package registers the built-in families and holds what is common to all of
them: the loss over a batch, run piece by piece."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxmega.core.compute import ComputeConfig
from fxmega.models import bert, deepseek_v3, gpt, llama, mixtral, registry, t5
from fxmega.models.family import ModelFamily
from fxmega.models.pieces import PieceCall, embed_inputs, head_inputs, run_pieces, top
from fxmega.ops import losses, recompute
from fxmega.ops.objectives import REFERENCE_OUTPUTS, Objective

for _family in (gpt, llama, bert, mixtral, t5, deepseek_v3):
    registry.register(_family.FAMILY)


def model_for(cfg: object) -> ModelFamily:
    """The family whose ``Config`` class ``cfg`` is (a ConfigError for an unregistered one)."""
    return registry.family_of(cfg)


def family_name(cfg: object) -> str:
    """The registered name of ``cfg``'s family."""
    return registry.name_of(cfg)


def head_loss_sum(model: ModelFamily) -> Callable[..., torch.Tensor]:
    """A piece function ``(head_params, x, cfg, targets, loss_mask, chunk) -> summed loss``:
    the model's final norm, then the output projection and cross-entropy a chunk of tokens
    at a time (``fxmega.ops.losses``), so the full logits never exist."""
    def run(params: dict, x: torch.Tensor, cfg: object, targets: torch.Tensor, loss_mask: torch.Tensor | None,
            chunk: int) -> torch.Tensor:
        h = model.final_hidden(params, x, cfg)
        return losses.chunked_cross_entropy_sum(h, model.output_weight(params), targets, loss_mask,
                                                cfg.vocab_size, chunk)
    return run


def loss_by_pieces(cfg: object, compute: ComputeConfig | None = None, model: ModelFamily | None = None,
                   objective: Objective | None = None,
                   reference: dict | None = None) -> Callable[[dict, dict, PieceCall, dict], torch.Tensor]:
    """``lm_loss_sum`` for ``cfg`` as a function of ``(params, batch, call, layouts)``: what a
    sharding runtime runs without knowing the model (``Parallel.loss_sum_fn``). ``reference``
    is the frozen model's tree of this rank's shards, laid out as ``params`` are."""
    def run(params: dict, batch: dict, call: PieceCall, layouts: dict) -> torch.Tensor:
        return lm_loss_sum(params, batch, cfg, call=call, layouts=layouts, compute=compute, model=model,
                           objective=objective, reference=reference)
    return run


def lm_loss_sum(params: dict, batch: dict[str, torch.Tensor], cfg: object, call: PieceCall | None = None,
                layouts: dict | None = None, compute: ComputeConfig | None = None, model: ModelFamily | None = None,
                objective: Objective | None = None, reference: dict | None = None) -> torch.Tensor:
    """An objective summed over ``batch``: the model run piece by piece (``run_pieces``: the
    embedding with the family's ``EMBED_INPUTS`` from the batch, every block with the batch's
    ``attention_mask``, the head with its ``HEAD_INPUTS``), then the objective on the head's
    outputs (``loss_mask`` honoured). Callers divide by the loss-term count of the whole
    global batch. ``model`` defaults to ``cfg``'s registered family (``fxmega.models.classifier``
    is one that is not registered), ``objective`` to the family's.

    ``call`` runs each piece (``Parallel._call`` on a mesh; ``recompute.plain_call`` when
    None); ``compute`` (a ``ComputeConfig``) adds block recompute and the chunked loss
    (``loss_chunk``: the head and the cross-entropy a chunk of tokens at a time).

    An objective that ``reads_reference`` gets the same pieces' outputs from ``reference`` (a
    frozen tree shaped and laid out as ``params``) under ``batch[REFERENCE_OUTPUTS]``,
    computed without gradient: the same casts, gathers and layouts as the trained model's."""
    model = model if model is not None else model_for(cfg)
    objective = objective if objective is not None else model.objective(cfg)
    if call is None:
        call, layouts = recompute.plain_call, params
    x = run_pieces(model, params, layouts, batch["inputs"], cfg, call, head=False, inputs=embed_inputs(model, batch),
                   valid=batch.get("attention_mask"), positions=batch.get("positions"), compute=compute)
    groups = model.head_groups(params)
    head_params, head_layouts = top(groups, params), top(groups, layouts)
    if compute is not None and compute.loss_chunk:
        return call(head_loss_sum(model), head_params, head_layouts, x, cfg, batch["targets"],
                    batch.get("loss_mask"), compute.loss_chunk)
    if objective.reads_reference:
        if reference is None:
            raise ValueError(f"the {objective.name} objective reads a reference model's outputs: pass reference=")
        with torch.no_grad():  # frozen: nothing of it is differentiated
            # one device's plain call reads no layouts; a mesh's are the same for both trees
            batch = {**batch, REFERENCE_OUTPUTS: outputs(model, reference, reference if layouts is params else layouts,
                                                         batch, cfg, call, compute)}
    loss_sum, _ = objective(call(model.head, head_params, head_layouts, x, cfg, *head_inputs(model, batch)), batch)
    return loss_sum


def outputs(model: ModelFamily, params: dict, layouts: dict, batch: dict[str, torch.Tensor], cfg: object,
            call: PieceCall, compute: ComputeConfig | None = None) -> torch.Tensor:
    """The head's outputs for ``batch`` (logits; vocab-parallel under tp), piece by piece."""
    return run_pieces(model, params, layouts, batch["inputs"], cfg, call, inputs=embed_inputs(model, batch),
                      valid=batch.get("attention_mask"), positions=batch.get("positions"), compute=compute,
                      head_inputs=head_inputs(model, batch))
