"""Sharding rules: which mesh axes each logical axis name is split over.

A rule set is a plain dict from logical name to a mesh axis, a tuple of mesh axes, or None
(never split). Names not in the dict are never split. The same table covers parameters
(their ``ParamSpec.axes``) and activations (the names model code passes to ``shard``).

Logical names used by fxmega's models:
  parameters   vocab, position, embed, heads, kv_heads, head_dim, qkv, mlp, expert (the
               experts stacked in a MoE layer), expert_logits (the router's output),
               shared_gate (the one output of the shared experts' gate)
  activations  batch, seq (the residual stream's sequence), ctx (the sequence inside a
               block), embed, heads, kv_heads, head_dim, mlp, vocab; attention's keys
               and values name the sequence ``None`` (whole)

Context parallelism (``cp`` in the mesh) splits ``seq`` and ``ctx`` over cp by construction,
like the batch over the data axes: neither cp nor ctx has a rule.

The batch is split over the mesh's data axes (dp, fsdp, and ep, which is folded over dp) by
construction, and over nothing else: each data rank reads its own micro batches (dp-major
over dp x fsdp x ep). It has no rule,
and a rule naming ``batch`` is refused rather than printed and ignored.

A strategy also has a ZeRO stage (``--zero``): how much state is sharded over the ``dp``
axis along each parameter's ``embed`` dim — 1: optimizer state, 2: + gradients, 3: +
parameters. The ``fsdp`` axis shards what the rules say (``"embed": "fsdp"``).

Write your own by copying one of these:

    rules = {**MEGATRON, "seq": "tp"}            # Megatron with sequence parallelism
    rules = {"embed": "fsdp", "mlp": "tp", "heads": "tp",
             "kv_heads": "tp", "vocab": "tp"}    # 2-D: FSDP over fsdp, TP over tp
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fxmega.core.errors import ConfigError

Rules = dict[str, "str | tuple[str, ...] | None"]

# Every logical name fxmega's models use, so that a typo in a rule is caught even when the
# model at hand does not use that (correctly spelled) name, e.g. kv_heads in GPT.
LOGICAL_AXES = ("batch", "seq", "embed", "vocab", "position", "heads", "kv_heads", "head_dim", "qkv", "mlp", "expert",
                "expert_logits", "shared_gate")

# Megatron-LM: column-parallel QKV and MLP-in (heads, kv_heads, mlp split over tp),
# row-parallel attention-out and MLP-out (their *input* dim is split, so the output is a
# partial sum that the next `shard` reduces), vocab-parallel embedding and cross-entropy.
MEGATRON: Rules = {
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert": "ep",  # expert parallelism: each ep rank holds 1/ep of a MoE layer's experts
}

# Sequence parallelism: between blocks the residual stream is split along the sequence
# over tp (LayerNorm and the residual add run on 1/tp of the tokens).
SEQUENCE_PARALLEL: Rules = {**MEGATRON, "seq": "tp"}

# FSDP: every parameter's `embed` dim split over the fsdp axis (gathered block by block
# inside the step); composes with the tp entries.
FSDP: Rules = {**MEGATRON, "embed": "fsdp"}


@dataclass(frozen=True)
class Strategy:
    rules: Rules = field(default_factory=lambda: dict(MEGATRON))
    zero: int = 0
    name: str = "custom"
    # ZeRO-1/2 as Megatron's distributed optimizer: flat buffers split in contiguous ranges
    # (fxmega.parallel.flat_optimizer) instead of each parameter split along its embed dim
    flat: bool = False


PRESETS: dict[str, Strategy] = {
    "megatron": Strategy(MEGATRON, 0, "megatron"),
    "megatron-sp": Strategy(SEQUENCE_PARALLEL, 0, "megatron-sp"),
    "zero1": Strategy(MEGATRON, 1, "zero1"),
    "zero2": Strategy(MEGATRON, 2, "zero2"),
    "zero3": Strategy(MEGATRON, 3, "zero3"),
    "fsdp": Strategy(FSDP, 0, "fsdp"),
    "hsdp": Strategy(FSDP, 0, "hsdp"),  # with a dp x fsdp mesh: replicate over dp, shard over fsdp
}


def preset(name: str) -> Strategy:
    if name not in PRESETS:
        raise ConfigError(f"unknown sharding preset {name!r}: use one of {', '.join(PRESETS)} "
                          f"or write rules in the config file (parallel.rules)")
    return PRESETS[name]


def mesh_axes_of(rule: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)
