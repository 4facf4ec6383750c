"""The model-family contract, declared: a family is one ``ModelFamily`` value that names its
pieces and what it can do, every optional capability with its default. Code that runs a
family reads these fields; it never probes a module for attributes.

A family module ends with ``FAMILY = ModelFamily(name=..., Config=Config, ...)`` and
``fxmega.models`` registers it (``fxmega.models.registry``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxmega.models.census import Saved
from fxmega.ops.layers import CacheWrite
from fxmega.ops.moe import MoE
from fxmega.ops.objectives import Objective
from fxmega.sharding.mesh import MeshSpec

# the logical axes of a head's outputs unless the family says otherwise (``OUTPUT_AXES``)
LOGITS = ("batch", "ctx", "vocab")


class ModelConfig(Protocol):
    """What every family's ``Config`` (a frozen dataclass) has."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    init_std: float

    def validate(self, prefix: str = ...) -> None: ...


# what each piece of the contract is: cfg is the family's own Config
ParamSpecs = Callable[[Any], dict]
Piece = Callable[..., torch.Tensor]
AttendInputs = Callable[..., Any]
BlockSaved = Callable[[Any, int, int, int], "tuple[Saved, ...]"]
CheckMesh = Callable[[ModelConfig, MeshSpec], None]


def no_mesh_limits(cfg: ModelConfig, mesh: MeshSpec) -> None:
    """A family that runs on every mesh the planner accepts."""


def no_experts(cfg: ModelConfig) -> MoE | None:
    """A dense family: no mixture-of-experts settings."""
    return None


def every_head_has_kv(cfg: ModelConfig) -> int:
    """Key/value heads of a family without grouped-query attention: one per query head."""
    return cfg.n_heads


def no_stats(cfg: ModelConfig) -> tuple[str, ...]:
    """A family whose layers report nothing through the step's meter."""
    return ()


def keeps(saved: tuple[Saved, ...]) -> BlockSaved:
    """``block_saved`` for a family whose every block keeps the same tensors."""
    return lambda cfg, index, seq_len, ep: saved


@dataclass(frozen=True)
class ModelFamily:
    """A model family.

    Pieces: ``embed(params, tokens, cfg, *EMBED_INPUTS)`` starts the residual stream
    ``[batch, seq, d_model]``; ``block(params, x, cfg, valid=None[, attend])`` is one layer on
    it; ``head(params, x, cfg, *HEAD_INPUTS)`` turns it into the objective's outputs.
    ``EMBED_PARAMS`` and ``HEAD_PARAMS`` are the top-level parameter groups the first and the
    last read (a tied embedding is in both; ``head_groups`` where the config adds to them),
    ``params["blocks"]`` the list of layers.
    ``objective(cfg)`` is what training minimises on the head's outputs."""

    name: str
    Config: type
    param_specs: ParamSpecs
    embed: Piece
    block: Piece
    head: Piece
    objective: Callable[[Any], Objective]
    EMBED_PARAMS: tuple[str, ...]
    HEAD_PARAMS: tuple[str, ...]
    # what ``embed`` and ``head`` read from the batch after the tokens / ``x`` and ``cfg``
    # (BERT's token types; a classifier's attention mask)
    EMBED_INPUTS: tuple[str, ...] = ()
    HEAD_INPUTS: tuple[str, ...] = ()
    # the logical axes of the head's outputs
    OUTPUT_AXES: tuple[str | None, ...] = LOGITS
    # top-level groups every block reads besides its own (T5's relative position tables)
    BLOCK_SHARED_PARAMS: tuple[str, ...] = ()
    # what every block's attention reads that no layer changes (rotary tables, masks), built
    # once per step: ``attend_inputs(cfg, seq_len, device, valid, positions)``, given to
    # blocks as ``block(params, x, cfg, valid, attend)``
    attend_inputs: AttendInputs | None = None
    # True when attend_inputs and the embedding honour each token's ``positions``, so that
    # context parallelism may hand the family out-of-order chunks of a sequence
    CONTEXT_PARALLEL: bool = False
    # BERT's embedding ends with a LayerNorm: ZeRO-3 gathers its parameters again for the backward
    EMBED_BACKWARD_READS_PARAMS: bool = False
    # what block ``index`` keeps for its backward (``fxmega.models.census``): the memory estimate needs it
    block_saved: BlockSaved | None = None
    # the final norm and the output projection apart, for the chunked loss (``compute.loss_chunk``)
    final_hidden: Piece | None = None
    output_weight: Callable[[dict], torch.Tensor] | None = None
    # what a classification head is put on: ``pool(params, x, valid, cfg) -> [batch, embed]``
    POOL_PARAMS: tuple[str, ...] = ()
    pool: Piece | None = None
    # decoding with a KV cache (``fxmega.inference``): the cache's shape per block, and where a step writes
    kv_cache_shape: Callable[[Any, int, int], tuple[int, ...]] | None = None
    # the second cached tensor's shape where it is not the first's (MLA caches a latent and a rotary key)
    v_cache_shape: Callable[[Any, int, int], tuple[int, ...]] | None = None
    decode_write: Callable[[Any, int, int, int, torch.Tensor], CacheWrite] | None = None
    # an encoder-decoder (T5): encode once, decode over the cache
    encode: Callable[..., Any] | None = None
    decode: Callable[..., Any] | None = None
    # a batch of the family's shapes, when it is more than tokens (T5's decoder inputs)
    example_batch: Callable[[Any, int, torch.device | str], dict[str, torch.Tensor]] | None = None
    # parameters one token passes through, when not all of them (MoE)
    active_params: Callable[[Any], int] | None = None
    # a config's mixture-of-experts settings when it has experts (FLOP counts, --mesh auto's ep sizes)
    experts: Callable[[Any], MoE | None] = no_experts
    # a config's key/value heads (grouped-query attention has fewer than query heads)
    kv_heads: Callable[[Any], int] = every_head_has_kv
    # meshes the family refuses before anything is built (experts not split over tp, ...)
    check_mesh: CheckMesh = no_mesh_limits
    # what its layers report to a step that meters them, in order (``fxmega.ops.aux_loss.measure``):
    # MoE routers' ROUTER_STATS, multi-token prediction's per-depth losses (``fxmega.ops.mtp``)
    meter_stats: Callable[[Any], tuple[str, ...]] = no_stats
    # the head's groups where they depend on which groups the parameter tree (specs or tensors)
    # has: DeepSeek-V3's multi-token prediction reads the embedding and its modules too
    head_groups_of: Callable[[dict], tuple[str, ...]] | None = None
    # validation's objective when it reports more than the loss (a classifier's accuracy)
    eval_objective: Callable[[Any], Objective] | None = None

    def head_groups(self, params: dict) -> tuple[str, ...]:
        """The top-level groups the head reads in a model whose parameters are ``params``
        (specs or tensors: a tree with the same top-level groups)."""
        return self.HEAD_PARAMS if self.head_groups_of is None else self.head_groups_of(params)

    @property
    def can_decode(self) -> bool:
        return self.kv_cache_shape is not None and self.decode_write is not None

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encode is not None and self.decode is not None

    @property
    def can_chunk_loss(self) -> bool:
        return self.final_hidden is not None and self.output_weight is not None
