"""Auxiliary losses from inside a block (MoE load balancing, router z-loss) that reach the
gradient without changing what a block returns.

A block returns only the residual stream, so that every path — one device, a mesh, a
pipeline's stages, recompute — runs blocks the same way. An auxiliary loss therefore rides
on the block's output: ``attach(x, aux_sum)`` returns ``x`` unchanged, and its backward adds
``d(aux_sum)/d(params) * scale`` to the gradient, as if ``aux_sum * scale`` had been added
to the loss (Megatron-LM's ``MoEAuxLossAutoScaler``). On a pipeline the stage that holds the
block injects it, so no stage has to carry losses to the last one.

``scale`` is the factor the step multiplies the summed main loss by before differentiating
it (``1 / tokens of the global batch``, times the fp16 loss scale): whoever differentiates
sets it with ``gradient_scale`` around the forward. An auxiliary sum is then summed over
tokens like the main loss (see ``fxmega.ops.moe``), so both are means over the same tokens
and the run does not depend on how the batch is split. Without a scale (evaluation,
generation) nothing is attached.

The scale is a tensor read from a module-level slot: ``torch.compile`` lifts it as a graph
input, so a new value each step does not recompile.

Statistics leave the step the same way, backwards: ``measure(x, stats, names)`` hands a
layer's values (a router's ``ROUTER_STATS``, multi-token prediction's per-depth losses) to
the backward as their part of the gradient of the step's *meter* (a zero vector the step
differentiates besides the parameters, one entry per name the family's ``meter_stats``
lists, set with ``metering``). Autograd sums
them over layers and the step over micro batches and data ranks, on every path that
differentiates the step's loss: recomputed blocks, ZeRO-3's gathered pieces, tp. A side
channel (a list the layer appends to) cannot: dynamo refuses outer mutations inside a
recomputed region.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from fxmega.ops.phases import backward_phase
from fxmega.sharding.layout import shard

_SCALE: list[torch.Tensor | None] = [None]
_METER: list[torch.Tensor | None] = [None]
_METER_NAMES: list[tuple[str, ...]] = [()]  # what each entry of the meter is

# What one MoE layer reports per micro batch (sums, so that layers, micro batches and data
# ranks add up): its per-sequence balancing loss and z-loss summed over sequences, the
# sequences, the (token, expert) pairs dropped over capacity and all pairs, the largest and
# smallest expert load over the mean load, and 1 (how many loads were measured)
ROUTER_STATS = ("balancing", "z_loss", "sequences", "dropped", "pairs", "load_max", "load_min", "loads")


@contextmanager
def gradient_scale(scale: torch.Tensor) -> Iterator[None]:
    """Inside, ``attach`` injects auxiliary losses multiplied by ``scale`` (a 0-dim tensor)."""
    previous = _SCALE[0]
    _SCALE[0] = scale
    try:
        yield
    finally:
        _SCALE[0] = previous


@contextmanager
def metering(meter: torch.Tensor | None, names: tuple[str, ...] = ()) -> Iterator[None]:
    """Inside, ``measure`` hands statistics to ``meter`` (a leaf that requires grad, one
    entry per name in ``names``) as its gradient; None: nothing is measured."""
    if meter is not None and meter.shape != (len(names),):
        raise ValueError(f"a meter of shape {tuple(meter.shape)} for the {len(names)} statistics {names}")
    previous = _METER[0], _METER_NAMES[0]
    _METER[0], _METER_NAMES[0] = meter, names
    try:
        yield
    finally:
        _METER[0], _METER_NAMES[0] = previous


StepState = tuple[torch.Tensor | None, torch.Tensor | None, tuple[str, ...]]


def step_state() -> StepState:
    """The scale and meter set now (``gradient_scale``, ``metering``), for ``restored``."""
    return _SCALE[0], _METER[0], _METER_NAMES[0]


@contextmanager
def restored(state: StepState) -> Iterator[None]:
    """Inside, the scale and meter are ``state``'s (an eager recompute in the backward runs
    the forward again after the step has left its ``gradient_scale`` and ``metering``)."""
    with gradient_scale(state[0]), metering(state[1], state[2]):
        yield


def in_step() -> bool:
    """Whether a training step differentiates the forward running now (its scale is set):
    the only time balancing terms, carried counts and statistics are used."""
    return _SCALE[0] is not None and torch.is_grad_enabled()


def measuring(names: tuple[str, ...] = ()) -> bool:
    """Whether a step meters the forward running now (``measure`` hands statistics on), and
    collects ``names`` (a run may leave some out: routers' statistics under cp)."""
    return _METER[0] is not None and torch.is_grad_enabled() and all(n in _METER_NAMES[0] for n in names)


def measure(x: torch.Tensor, stats: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
    """``x``, carrying ``stats`` (one value per name in ``names``, a run of the meter's
    names) into the backward as their entries of the meter's gradient when a step meters."""
    if not measuring():
        return x
    meter, layout = _METER[0], _METER_NAMES[0]
    start = layout.index(names[0]) if names and names[0] in layout else -1
    if start < 0 or layout[start:start + len(names)] != names:
        raise ValueError(f"statistics {names} are not a run of the step's meter {layout}: the family's "
                         f"meter_stats must list them")
    value = torch.nn.functional.pad(stats.to(meter.dtype), (start, len(layout) - start - len(names)))
    # shard: the meter replicated over tp, like the statistics of tp-replicated routing and losses
    return _GradientInto.apply(x, shard(meter, None), value)


def router_report(stats: Sequence[float]) -> dict[str, float]:
    """The step's summed ``stats`` (read from the device, one per ``ROUTER_STATS`` name) as
    the numbers a log shows: the balancing loss and z-loss per sequence and layer (before
    their coefficients), the largest and smallest expert load over the mean (per layer and
    micro batch, averaged), the fraction of pairs dropped."""
    v = dict(zip(ROUTER_STATS, stats))
    if not v["loads"]:
        return {}
    return {"moe_balancing_loss": v["balancing"] / v["sequences"], "moe_z_loss": v["z_loss"] / v["sequences"],
            "moe_load_max": v["load_max"] / v["loads"], "moe_load_min": v["load_min"] / v["loads"],
            "moe_dropped_fraction": v["dropped"] / v["pairs"]}


class _GradientInto(torch.autograd.Function):
    """``x`` unchanged forward; backward, ``value`` becomes ``target``'s gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(value)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        with backward_phase():  # one backward region with the step's other custom backwards
            (value,) = ctx.saved_tensors
            return grad, value, None


def carry(x: torch.Tensor, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``x``, handing ``value`` (shaped like ``param``) to the backward as ``param``'s
    gradient, unscaled, when a step's scale is set: how a count the forward observes (tokens
    per expert) reaches a parameter updated from counts rather than a loss (``ParamSpec.
    sign_rate``), summed over micro batches and data ranks by the gradient reduction itself."""
    if not in_step():
        return x
    return _GradientInto.apply(x, param, value.to(param.dtype))


def attach(x: torch.Tensor, aux_sum: torch.Tensor) -> torch.Tensor:
    """``x``, carrying ``aux_sum`` (a 0-dim sum, fp32 or wider) into the backward when a scale is set."""
    if not in_step():
        return x
    scale = _SCALE[0]
    # d(aux_sum x scale)/d(aux_sum) = scale; shard: replicated over tp, like aux_sum
    return _GradientInto.apply(x, aux_sum, shard(scale).to(aux_sum.dtype).reshape(()))
