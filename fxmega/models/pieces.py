"""The one forward by pieces: embedding, blocks, head, each run through a ``call``.

Every path that runs a model for training — the single-device and mesh step, a pipeline's
stages, fine-tuning, evaluation — goes through ``run_pieces``, so they cannot disagree on
what a piece is given: the embedding gets the tokens and what the family's ``EMBED_INPUTS``
names (BERT's token types), every block gets the attention mask of a padded batch, and
the recompute mode is chosen per block by its global index.

``call(piece_fn, piece_params, piece_layouts, *args, recompute=mode)`` is where the caller
puts its own work around a piece: ``recompute.plain_call`` on one device (activation
checkpointing), ``Parallel._call`` on a mesh (cast, ZeRO-3 gather, checkpointing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fxmega.core.compute import ComputeConfig
from fxmega.models.family import ModelConfig, ModelFamily
from fxmega.ops.layers import KV, CacheWrite
from fxmega.ops.recompute import mode_for_block

PieceCall = Callable[..., torch.Tensor]


def top(groups: tuple[str, ...], params: dict) -> dict:
    """The top-level parameter groups a piece reads (so a gathering call gathers no more)."""
    return {g: params[g] for g in groups}


def blocks_of(params: dict) -> list[tuple[int, dict]]:
    """``(global index, block tree)`` for the blocks ``params`` holds: all of them (a list),
    or a pipeline stage's (a dict keyed by the global index)."""
    blocks = params["blocks"]
    if isinstance(blocks, dict):
        return [(i, blocks[str(i)]) for i in sorted(int(k) for k in blocks)]  # ints: dynamo sorts those
    return list(enumerate(blocks))


def run_pieces(model: ModelFamily, params: dict, layouts: dict, x: torch.Tensor, cfg: ModelConfig, call: PieceCall, *,
               embed: bool = True, head: bool = True, inputs: Sequence[torch.Tensor] = (),
               valid: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               compute: ComputeConfig | None = None, head_inputs: Sequence[torch.Tensor | None] = ()) -> torch.Tensor:
    """``x`` through the pieces ``params`` holds, in order: the embedding (if ``embed``:
    ``x`` is then the tokens and ``inputs`` the family's ``EMBED_INPUTS``), every block in
    ``params["blocks"]`` (with ``valid``, the attention mask, and the family's
    ``attend_inputs`` built once from it and ``positions``, each token's place when the
    tokens are out of order), and the head (if
    ``head``, with ``head_inputs``: the family's ``HEAD_INPUTS``). ``layouts`` mirrors
    ``params``; ``compute`` (a ``ComputeConfig``) picks each block's recompute mode."""
    mode, first_n = (compute.recompute, compute.recompute_layers) if compute is not None else ("none", 0)
    if embed:
        x = call(model.embed, top(model.EMBED_PARAMS, params), top(model.EMBED_PARAMS, layouts), x, cfg, *inputs)
    # the blocks' optional inputs, positional (a piece call passes arguments on as they are):
    # what attention reads that no layer changes (rotary tables, masks) is built here, once
    blocks = blocks_of(params)
    attend = model.attend_inputs
    if attend is not None and blocks:
        extra: tuple = (valid, attend(cfg, x.shape[1], x.device, valid, positions))
    else:
        extra = () if valid is None else (valid,)
    lays = dict(blocks_of(layouts))
    shared = model.BLOCK_SHARED_PARAMS  # top-level groups every block reads too
    for i, p in blocks:
        p, lay = (p | top(shared, params), lays[i] | top(shared, layouts)) if shared else (p, lays[i])
        x = call(model.block, p, lay, x, cfg, *extra, recompute=mode_for_block(mode, i, first_n))
    if head:
        groups = model.head_groups(params)
        x = call(model.head, top(groups, params), top(groups, layouts), x, cfg, *head_inputs)
    return x


def embed_inputs(model: ModelFamily, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What the family's embedding reads from ``batch`` besides the tokens, in its argument
    order, up to the first the batch lacks (the embedding's defaults take the rest)."""
    out = []
    for key in model.EMBED_INPUTS:
        if key not in batch:
            break
        out.append(batch[key])
    return out


def head_inputs(model: ModelFamily, batch: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    """What the family's head reads from ``batch`` (``HEAD_INPUTS``), None where it is absent
    (a batch without padding has no attention mask)."""
    return [batch.get(key) for key in model.HEAD_INPUTS]


def output_axes(model: ModelFamily) -> tuple[str | None, ...]:
    """The logical axes of the family's head outputs."""
    return model.OUTPUT_AXES


def init_cache(model: ModelFamily, cfg: ModelConfig, blocks: Sequence[int], batch: int, max_len: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict[int, KV]:
    """An empty KV cache for the blocks ``blocks`` (global indices: a pipeline stage caches
    only its own), each ``(k, v)`` of the family's ``kv_cache_shape`` (``v`` of its
    ``v_cache_shape`` where it declares one)."""
    shapes = cache_shapes(model, cfg, batch, max_len)
    return {i: tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes) for i in blocks}


def cache_shapes(model: ModelFamily, cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple[int, ...], ...]:
    """The two tensors each block caches: the family's ``kv_cache_shape``, and its
    ``v_cache_shape`` or the same again."""
    k = tuple(model.kv_cache_shape(cfg, batch, max_len))
    return k, (tuple(model.v_cache_shape(cfg, batch, max_len)) if model.v_cache_shape is not None else k)


def decode_pieces(model: ModelFamily, params: dict, x: torch.Tensor, cfg: ModelConfig, cache: dict[int, KV],
                  write: CacheWrite, *,
                  embed: bool = True, head: bool = True, last_only: bool = False) -> tuple[torch.Tensor, dict[int, KV]]:
    """The forward by pieces while decoding: the same embedding, blocks and head as
    ``run_pieces``, for new tokens written into the cache at ``write`` (the family's
    ``decode_write``): the embedding at each row's positions, every block in ``params`` reading
    and extending its cache entry, the head on the last position only with ``last_only``.
    Returns the output (tokens in, logits out when ``head``) and the blocks' new cache
    entries; ``cache`` itself is unchanged. A pipeline stage runs the pieces it holds."""
    if embed:
        x = model.embed(top(model.EMBED_PARAMS, params), x, cfg, positions=write.positions)
    new: dict[int, KV] = {}
    for i, p in blocks_of(params):
        x, new[i] = model.block(p, x, cfg, cache=cache[i], write=write)
    if head:
        x = model.head(top(model.head_groups(params), params), x[:, -1:] if last_only else x, cfg)
    return x, new
