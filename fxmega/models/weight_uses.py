"""Which parameters each weight matmul of a model reads, and as what: the model's loss run
once on meta tensors (shapes, no data, no memory) with a recording matmul recipe.

What an fp8 recipe casts is decided at the matmul (``ops.matmul``: a role and a 2-D
weight), not on the parameter; an fp8 gather of ZeRO-3's parameters (``ops.fp8``,
``parallel.zero3``) must know it before the matmul runs. This finds it by running the
matmuls rather than by a second declaration that could disagree with them.
"""

from __future__ import annotations

import torch

from fxmega.core import tree
from fxmega.models import lm_loss_sum, model_for
from fxmega.models.family import ModelFamily
from fxmega.ops import fp8, matmul
from fxmega.ops.init import meta_params
from fxmega.ops.matmul import WeightUse
from fxmega.ops.objectives import Objective

TRACE_TOKENS = 8  # the weights' shapes do not depend on the sequence: a short one is enough


def weight_uses(cfg: object, model: ModelFamily, objective: Objective) -> dict[str, list[WeightUse]]:
    """``path -> [WeightUse, ...]`` for every parameter a weight matmul of ``model``'s loss
    reads (one device, full shapes); parameters no matmul reads (embedding tables read by a
    lookup, norms, biases) are absent."""
    params = meta_params(model.param_specs(cfg))
    by_id = {id(p): path for path, p in zip(tree.paths(params), tree.leaves(params))}
    if model.example_batch is not None:  # a family whose batches are more than tokens (T5)
        batch = model.example_batch(cfg, 1, "meta")
    else:
        tokens = torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device="meta")
        batch = {"inputs": tokens, "targets": tokens, **{k: tokens for k in model.EMBED_INPUTS}}
    uses: dict[str, list[WeightUse]] = {}
    with matmul.use(matmul.recording(by_id, uses)):
        lm_loss_sum(params, batch, cfg, model=model, objective=objective)
    return uses


def fp8_gathered(cfg: object, tp_shapes: dict[str, tuple[int, ...]], model: ModelFamily | None = None,
                 objective: Objective | None = None) -> frozenset[str]:
    """The parameters ZeRO-3 gathers in fp8 under ``compute.fp8_gather``: those the fp8
    recipe's matmuls cast (``ops.fp8.gathered_in_fp8``), each a rank's ``tp_shapes`` slice."""
    model = model if model is not None else model_for(cfg)
    objective = objective if objective is not None else model.objective(cfg)
    return fp8.gathered_in_fp8(weight_uses(cfg, model, objective), tp_shapes)


def fp8_matmul_count(cfg: object, tp_shapes: dict[str, tuple[int, ...]] | None = None,
                     model: ModelFamily | None = None, objective: Objective | None = None) -> tuple[int, int]:
    """``(taken, linear)``: how many of ``model``'s linear weight matmuls (per call) the fp8
    recipe runs in fp8 — the 2-D weight a rank multiplies, its ``tp_shapes`` slice where given,
    has both dims multiples of 16 — out of how many linear matmuls there are."""
    model = model if model is not None else model_for(cfg)
    objective = objective if objective is not None else model.objective(cfg)
    fp8_filter = fp8.Fp8Filter()
    taken = linear = 0
    for path, reads in weight_uses(cfg, model, objective).items():
        for use in reads:
            if use.role not in fp8_filter.roles:
                continue
            linear += 1
            shape = use.local_matmul_shape((tp_shapes or {}).get(path, use.param_shape))
            taken += shape is not None and fp8_filter.accepts_shape(shape, use.role)
    return taken, linear
