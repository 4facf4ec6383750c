"""Generation with the KV cache on a sharded run's mesh: tensor-parallel decoding, as Megatron
serves a model too large for one device.

``generate_on_mesh(run, prompts, ...)`` is ``generate.generate_cached`` (same arguments, same
return, the same loop: request checks, left padding, sampling, stop tokens) on ``run``'s
parameters where they are. With tp > 1 the loop is handed a model (``TPDecoder``) whose
``init_cache`` and ``decode_forward`` run on this rank's shards:

* the parameters stay split as in training (heads, kv heads, mlp and the padded vocabulary over
  tp), wrapped as DTensors over the tp mesh; the forward runs under ``layout.activate``, so the
  model's own ``shard``/``local`` annotations give Megatron's column- and row-parallel layouts;
* each layer's cache holds only this rank's heads: a DTensor split over heads (dim 2), locally
  ``[batch, max_len, kv_heads / tp, head_dim]``;
* each step's last-position logits, split over the vocabulary, are all-gathered (``[batch, 1,
  padded vocab]``: a few KB, against the per-layer all-reduces of the forward), so every rank
  holds bitwise the same logits. Greedy argmax and sampling from the same seeded generator then
  pick the same token on every rank with no broadcast; ``generate_cached`` drops the padding
  columns (beyond ``cfg.vocab_size``) before it samples;
* sequence parallelism is off while decoding: a step has one token per row, nothing to split.

Every rank must call, with the same prompts and settings. Other meshes take the simple route:
without ``run.parallel`` it is ``generate_cached`` on ``run.params``; with tp = 1 (data
parallelism, ZeRO, FSDP) or with pipeline stages, the full parameters are gathered once
(``run.full_params``) and every rank decodes the whole batch itself. With data axes next to tp,
ZeRO-3/FSDP shards are gathered over the data axes only, and every data replica decodes the
whole batch. Parameters are used in their stored dtype (fp32 masters), not the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fxmega import layers, tree
from fxmega.generate import generate_cached
from fxmega.model_loader import full_params
from fxmega.sharding import layout

# the heads dim of a cache tensor [batch, max_len, kv_heads, head_dim]
CACHE_HEADS_DIM = 2


class DecodeLayout:
    """The run's activation layouts for decoding: those of training, except that the sequence is
    never split (sequence parallelism has nothing to split in a one-token step)."""

    def __init__(self, parallel: Any) -> None:
        self.parallel = parallel

    @staticmethod
    def _whole_seq(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
        return tuple(None if a == "seq" else a for a in axes)

    def constrain(self, x: Any, axes: tuple[str | None, ...]) -> Any:
        return self.parallel.constrain(x, self._whole_seq(axes))

    def local(self, fn: Callable[..., Any], in_axes: tuple[tuple[str | None, ...] | None, ...],
              out_axes: tuple[str | None, ...]) -> Callable[..., Any]:
        in_axes = tuple(None if a is None else self._whole_seq(a) for a in in_axes)
        return self.parallel.local(fn, in_axes, self._whole_seq(out_axes))


def tp_params(parallel: Any, params: tree.Tree) -> tree.Tree:
    """This rank's parameters as DTensors over the tp mesh (split where training splits them, as
    ``Parallel._wrap`` does in the step). Shards over data axes (ZeRO-3, FSDP) are gathered over
    those axes first (a collective: every rank calls), since decoding reads each parameter whole
    at every step."""
    def one(local: torch.Tensor, lay: Any) -> DTensor:
        local = local.detach()
        if lay.data_axes["param"]:
            only_tp = [Shard(lay.tp_dim) if axis == "tp" and lay.tp_dim is not None else Replicate()
                       for axis in parallel.spec.names]
            local = parallel.as_dtensor(local, lay).redistribute(parallel.device_mesh, only_tp).to_local()
        placement = Replicate() if lay.tp_dim is None else Shard(lay.tp_dim)
        return DTensor.from_local(local, parallel.tp_mesh, [placement], run_check=False)

    return tree.map_leaves(one, params, parallel.layout_tree)


class TPDecoder:
    """``model``'s ``init_cache`` and ``decode_forward`` on this rank's tp shards: the model that
    ``generate_cached`` is given under tp. ``decode_forward`` takes ``tp_params`` and plain
    tokens, and returns the logits gathered over the vocabulary as a plain tensor (padding
    columns included) with the cache still split over heads."""

    def __init__(self, model: ModuleType, parallel: Any) -> None:
        if parallel.tp_mesh is None:
            raise ValueError("TPDecoder needs a run with tp > 1; use generate_on_mesh for any mesh")
        self.model = model
        self.parallel = parallel
        self.layout = DecodeLayout(parallel)

    def init_cache(self, cfg: Any, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> list[layers.KV]:
        """The model's empty cache, but each tensor holding only this rank's heads."""
        mesh, tp = self.parallel.tp_mesh, self.parallel.tp
        full = self.model.init_cache(cfg, batch, max_len, dtype, "meta")  # shapes only: nothing is allocated

        def part(t: torch.Tensor) -> DTensor:
            shape = list(t.shape)
            if shape[CACHE_HEADS_DIM] % tp:  # the plan refuses such a model before this
                raise ValueError(f"{shape[CACHE_HEADS_DIM]} cached heads do not split over tp={tp}")
            shape[CACHE_HEADS_DIM] //= tp
            local = torch.zeros(shape, dtype=dtype, device=device)
            return DTensor.from_local(local, mesh, [Shard(CACHE_HEADS_DIM)], run_check=False)

        return [(part(k), part(v)) for k, v in full]

    def decode_forward(self, params: tree.Tree, tokens: torch.Tensor, cfg: Any, cache: list[layers.KV], start: int,
                       pad: torch.Tensor | None = None,
                       last_only: bool = False) -> tuple[torch.Tensor, list[layers.KV]]:
        # every tp rank reads the same tokens (as in training's loss); pad stays plain, and so
        # does the CacheWrite built from it: the model's ``shard`` calls convert what meets DTensors
        tokens = DTensor.from_local(tokens, self.parallel.tp_mesh, [Replicate()], run_check=False)
        with layout.activate(self.layout):
            logits, cache = self.model.decode_forward(params, tokens, cfg, cache, start, pad, last_only)
        return logits.full_tensor(), cache


@torch.no_grad()
def generate_on_mesh(run: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
                     seed: int = 0) -> list[list[int]]:
    """The new tokens for each prompt (``generate_cached``'s semantics and return), decoded on
    ``run``'s mesh: tensor-parallel with the parameters and the KV cache split over tp when
    ``run.parallel`` has tp > 1 (see the module docstring for the other meshes). Every rank must
    call with the same arguments, and every rank returns the same tokens."""
    par = run.parallel
    cfg = run.cfg.model
    args = (prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed)
    if par is None:
        return generate_cached(run.model, run.params, cfg, *args)
    if par.tp_mesh is None or par.plan.pipeline is not None:
        return generate_cached(run.model, full_params(run), cfg, *args)
    return generate_cached(TPDecoder(run.model, par), tp_params(par, run.params), cfg, *args)
