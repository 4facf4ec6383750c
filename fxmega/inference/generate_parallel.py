"""Generation on a sharded run's mesh: tensor-parallel decoding within each pipeline stage,
stages passing activations, as Megatron serves a model too large for one device.

``generate_on_mesh(holder, prompts, ...)`` is ``generate.decode`` (same arguments, same return,
the same loop) with a ``MeshDecoder`` over the parameters where they are:

* **tp**: the parameters stay split as in training (heads, kv heads, mlp and the padded
  vocabulary over tp), wrapped as DTensors over the tp mesh; the pieces run under
  ``layout.activate``, so the model's own ``shard``/``local`` annotations give Megatron's
  column- and row-parallel layouts. Each block's cache holds only this rank's heads (a
  DTensor split over heads, locally ``[batch, max_len, kv_heads / tp, head_dim]``). The last
  position's logits, split over the vocabulary, are gathered (a few KB against the per-layer
  all-reduces), so every rank holds the same logits; sequence parallelism is off while
  decoding (a step has one token per row, nothing to split).
* **pp**: each pp rank holds its stages' blocks and caches only those; a stage's output goes
  to the next stage's rank (a point-to-point send over pp), and the last stage's logits are
  broadcast over pp. Interleaved layouts (several stages per rank) work the same way.
* **data axes** (dp, ZeRO, FSDP): ZeRO-3/FSDP shards are gathered over the data axes once
  (decoding reads each parameter whole at every step); each data replica decodes its share
  of the prompts (rows ``r, r + dp, ...``) and the completions are all-gathered over the data
  axes. Each row samples from its own seeded generator, so a share samples what one device
  samples for those rows.

Every rank must call with the same prompts and settings, and every rank returns the same
tokens: greedy argmax and sampling from the same seeded generator pick the same token from
the same logits with no broadcast. Parameters are used in their stored dtype (fp32 masters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fxmega.core import tree
from fxmega.inference.generate import Cache, LocalDecoder, decode
from fxmega.models.family import ModelConfig, ModelFamily
from fxmega.models.pieces import blocks_of, cache_shapes, decode_pieces
from fxmega.parallel.activation_layouts import ActivationLayouts
from fxmega.parallel.runtime import Parallel
from fxmega.sharding import layout
from fxmega.sharding.pipeline import Stage

# the heads dim of a cache tensor [batch, max_len, kv_heads, head_dim]
CACHE_HEADS_DIM = 2


class DecodeLayout:
    """The run's activation layouts for decoding: those of training over tp only, the sequence
    never split (sequence parallelism has nothing to split in a one-token step; context
    parallel ranks each decode the whole batch, the same on every one)."""

    context = None  # no cp: each rank decodes the whole sequence

    def __init__(self, parallel: Parallel) -> None:
        self.layouts = ActivationLayouts(parallel.plan, parallel.groups.tp_mesh)  # no cp: each decodes it all

    @staticmethod
    def _whole_seq(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
        return tuple(None if a == "seq" else a for a in axes)

    def constrain(self, x: Any, axes: tuple[str | None, ...]) -> Any:
        return self.layouts.constrain(x, self._whole_seq(axes))

    def local(self, fn: Callable[..., Any], in_axes: tuple[tuple[str | None, ...] | None, ...],
              out_axes: tuple[str | None, ...], partial: bool = False) -> Callable[..., Any]:
        in_axes = tuple(None if a is None else self._whole_seq(a) for a in in_axes)
        return self.layouts.local(fn, in_axes, self._whole_seq(out_axes), partial)


def decode_params(parallel: Parallel, params: tree.Tree) -> tree.Tree:
    """This rank's parameters for decoding: shards over data axes (ZeRO-3, FSDP) gathered over
    those axes (a collective: every rank calls), and under tp wrapped as DTensors over the tp
    mesh, split where training splits them (as ``Parallel._wrap`` does in the step).

    Experts split over ep are gathered too: decoding runs every expert on every rank (a
    batch of one token per sequence gains nothing from all-to-all dispatch), so an ep mesh
    generates with each rank holding all the experts of its pipeline stages."""
    def one(local: torch.Tensor, lay: Any) -> torch.Tensor:
        local = local.detach()
        if lay.data_axes["param"] or lay.ep_dim is not None:
            only_tp = [Shard(lay.tp_dim) if axis == "tp" and lay.tp_dim is not None else Replicate()
                       for axis in parallel.groups.mesh.names]
            local = parallel.shards.as_dtensor(local, lay).redistribute(parallel.groups.device_mesh, only_tp).to_local()
        if parallel.groups.tp_mesh is None:
            return local
        placement = Replicate() if lay.tp_dim is None else Shard(lay.tp_dim)
        return DTensor.from_local(local, parallel.groups.tp_mesh, [placement], run_check=False)

    return tree.map_leaves(one, params, parallel.shards.layout_tree)


class MeshDecoder:
    """The forward by pieces on this rank's share of a mesh (see the module docstring): a
    ``generate.Decoder`` for ``decode``. ``params`` are this rank's local tensors, as
    training holds them."""

    def __init__(self, model: ModelFamily, parallel: Parallel, params: tree.Tree, cfg: ModelConfig) -> None:
        self.model, self.parallel, self.cfg = model, parallel, cfg
        self.params = decode_params(parallel, params)
        self.dtype = tree.leaves(params)[0].dtype
        self.device = tree.leaves(params)[0].device
        self.tp_mesh = parallel.groups.tp_mesh
        self.layout = DecodeLayout(parallel) if self.tp_mesh is not None else None
        pipe = parallel.plan.pipeline
        if pipe is None:
            self.stages = [Stage(0, 0, True, tuple(i for i, _ in blocks_of(params)), True)]
            self.me, self.group, self.stage_params = 0, None, [self.params]
            return
        self.stages = list(pipe.stages)
        self.me = parallel.groups.coords["pp"]
        self.group = parallel.groups.group(("pp",)).get_group()
        head_groups = model.head_groups(self.params)
        self.stage_params = [s.params_of(self.params, model.EMBED_PARAMS, head_groups) if s.rank == self.me
                             else None for s in self.stages]

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """Empty caches of this rank's blocks; under tp each holds only this rank's heads."""
        tp = self.parallel.groups.tp

        def part(full: tuple[int, ...]) -> torch.Tensor:
            shape = list(full)
            if shape[CACHE_HEADS_DIM] % tp:  # the plan refuses such a model before this
                raise ValueError(f"{shape[CACHE_HEADS_DIM]} cached heads do not split over tp={tp}")
            shape[CACHE_HEADS_DIM] //= tp
            local = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.tp_mesh is None:
                return local
            return DTensor.from_local(local, self.tp_mesh, [Shard(CACHE_HEADS_DIM)], run_check=False)

        shapes = cache_shapes(self.model, self.cfg, batch, max_len)
        return {i: tuple(part(shape) for shape in shapes) for s in self.stages if s.rank == self.me for i in s.blocks}

    def _replicated(self, x: torch.Tensor) -> torch.Tensor:
        # what every tp rank holds whole (the tokens, a received residual) as the DTensor it is
        return x if self.tp_mesh is None else DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)

    def forward(self, tokens: torch.Tensor, cache: Cache, start: int, pad: torch.Tensor, max_len: int,
                last_only: bool = False) -> tuple[torch.Tensor, Cache]:
        write = self.model.decode_write(self.cfg, start, tokens.shape[1], max_len, pad)
        batch, new_tokens = tokens.shape
        x: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        new: Cache = {}
        with layout.activate(self.layout):
            for s, params in zip(self.stages, self.stage_params):
                if s.rank != self.me:
                    continue
                if s.embed:
                    x = self._replicated(tokens)
                elif x is None or self.stages[s.index - 1].rank != self.me:  # from the previous stage's rank
                    x = torch.empty(batch, new_tokens, self.cfg.d_model, dtype=self.dtype, device=self.device)
                    dist.recv(x, self._global(self.stages[s.index - 1].rank), group=self.group)
                    x = self._replicated(x)
                x, part = decode_pieces(self.model, params, x, self.cfg, cache, write, embed=s.embed, head=s.head,
                                        last_only=last_only)
                new |= part
                x = x.full_tensor() if isinstance(x, DTensor) else x
                if s.head:
                    logits = x
                elif self.stages[s.index + 1].rank != self.me:
                    dist.send(x.contiguous(), self._global(self.stages[s.index + 1].rank), group=self.group)
        if self.group is not None:  # every pp rank gets the last stage's logits
            if logits is None:
                logits = torch.empty(batch, 1 if last_only else new_tokens, self.parallel.plan.padded_vocab_size,
                                     dtype=self.dtype, device=self.device)
            dist.broadcast(logits, self._global(self.stages[-1].rank), group=self.group)
        return logits, new


class Configured(Protocol):
    """A run config, as far as generation reads it."""

    model: ModelConfig


class ModelHolder(Protocol):
    """Whatever holds a model's parameters on this rank: a ``LoadedModel`` or a training
    ``Run``."""

    cfg: Configured
    model: ModelFamily
    params: dict
    parallel: Parallel | None


@torch.no_grad()
def generate_on_mesh(holder: ModelHolder, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
                     seed: int = 0, on_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
    """The new tokens for each prompt (``generate.decode``'s semantics and return), decoded where
    ``holder``'s parameters are (a ``LoadedModel`` or a training ``Run``: its ``model``,
    ``params``, ``parallel`` and ``cfg``). Every rank must call with the same arguments, and
    every rank returns the same tokens. ``on_token`` (``decode``'s) hears this rank's rows: all of
    them without data parallelism, else rows r, r + dp, ... on data rank r."""
    cfg = holder.cfg.model
    par = holder.parallel
    if par is None:
        return decode(LocalDecoder(holder.model, holder.params, cfg), cfg, prompts, max_new_tokens, temperature, top_k,
                      top_p, stop_tokens, seed, on_token=on_token)
    decoder = MeshDecoder(holder.model, par, holder.params, cfg)
    if par.groups.data_size == 1:
        return decode(decoder, cfg, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed,
                      on_token=on_token)
    # data replicas decode independent prompts: rows r, r + dp, r + 2 dp, ... on data rank r
    mine = list(range(par.groups.data_rank, len(prompts), par.groups.data_size))
    outs = decode(decoder, cfg, [prompts[i] for i in mine], max_new_tokens, temperature, top_k, top_p, stop_tokens,
                  seed, rows=mine, on_token=on_token)
    everyone: list[dict[int, list[int]]] = [{}] * par.groups.data_size
    dist.all_gather_object(everyone, dict(zip(mine, outs)), group=par.groups.group(par.groups.data_axes).get_group())
    merged = {row: ids for part in everyone for row, ids in part.items()}
    return [merged[i] for i in range(len(prompts))]
