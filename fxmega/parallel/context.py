"""Context parallelism's split of the sequence: each of ``cp`` ranks holds two of ``2 cp``
equal chunks, chunk ``r`` and chunk ``2 cp - 1 - r`` (the head-tail, or "zigzag", order of
Megatron-LM/Transformer Engine and torchtitan). Under a causal mask a query attends to the
keys before it, so early chunks are cheap and late ones dear; pairing the r-th from the
front with the r-th from the back gives every rank the same attention work.

The model sees the rank's tokens in that order with each token's ``positions``, from which
the learned position embedding, the rotary tables and the causal mask are all taken. Each
rank holds its chunks as plain local tensors, so everything but attention runs on 1/cp of
the tokens with no communication; ``ContextParallel`` holds the collectives that reach
across ranks: attention's gathers, all-to-alls or ring exchanges (``ring_attention``), and
the sum of every parameter's gradient (each rank's is a partial sum over its own tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from fxmega.config import RunConfig
from fxmega.core.errors import ConfigError
from fxmega.models.family import ModelFamily
from fxmega.ops.phases import backward_phase
from fxmega.parallel.ring_attention import ring_attention
from fxmega.sharding.mesh import MeshSpec


class SumGradOverContext(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over cp (a parameter's gradient on a
    cp rank is the part its own tokens contribute)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with backward_phase():
            return funcol.all_reduce(grad, "sum", ctx.group), None


class ContextParallel:
    """The collectives of context parallelism over this rank's cp group (a 1-D mesh)."""

    def __init__(self, group: Any, size: int, mode: str, rank: int) -> None:
        self.group, self.size, self.mode, self.rank = group, size, mode, rank

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's chunks along ``dim``, in rank order (the head-tail order of the whole
        sequence); the backward reduce-scatters the gradient back to the chunks' owners."""
        return funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=dim, group=self.group)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq/cp, heads, d]`` -> ``[batch, seq, heads/cp, d]`` by one all-to-all:
        rank j receives head group j of every rank's chunks (Ulysses)."""
        b, s, h, d = x.shape
        parts = x.reshape(b, s, self.size, h // self.size, d).permute(2, 0, 1, 3, 4).contiguous()
        got = funcol.all_to_all_single_autograd(parts, None, None, self.group)  # [source rank, b, s, h/cp, d]
        return got.permute(1, 0, 2, 3, 4).reshape(b, self.size * s, h // self.size, d)

    def from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_heads``: back to this rank's chunks with every head."""
        b, s, h, d = x.shape
        parts = x.reshape(b, self.size, s // self.size, h, d).permute(1, 0, 2, 3, 4).contiguous()
        got = funcol.all_to_all_single_autograd(parts, None, None, self.group)  # [head group, b, s/cp, h, d]
        return got.permute(1, 2, 0, 3, 4).reshape(b, s // self.size, self.size * h, d)

    def rotate(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Send ``tensors`` to the next rank of the ring and return the previous rank's:
        one all-to-all per dtype in which only the neighbours' parts are not empty."""
        got: dict[int, torch.Tensor] = {}
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].reshape(-1) for i in mine])
            send, recv = [0] * self.size, [0] * self.size
            send[(self.rank + 1) % self.size] = recv[(self.rank - 1) % self.size] = flat.numel()
            parts = funcol.all_to_all_single(flat, recv, send, self.group).split([tensors[i].numel() for i in mine])
            got |= {i: p.view(tensors[i].shape) for i, p in zip(mine, parts)}
        return tuple(got[i] for i in range(len(tensors)))

    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's chunks over the whole sequence, keys and values
        passed around the ring."""
        return ring_attention(self, q, k, v)

    def sum_grads(self, x: torch.Tensor) -> torch.Tensor:
        return SumGradOverContext.apply(x, self.group)


def check_context_parallel(cfg: RunConfig, mesh: MeshSpec, model: ModelFamily) -> None:
    """Refuse, before anything is built, what context parallelism does not do (yet)."""
    cp = mesh.size("cp")
    if cp == 1:
        return
    if not model.CONTEXT_PARALLEL:
        raise ConfigError(f"--mesh {cfg.parallel.mesh}: the {model.name} model does not take out-of-order positions, "
                          f"which context parallelism needs (GPT, Llama and DeepSeek-V3 do): drop cp")
    head_tail_order(cfg.train.seq_len, cp)  # the sequence splits into 2 cp chunks
    if cfg.parallel.cp_attention == "a2a":
        ways = cp * mesh.size("tp")
        heads = {"heads": cfg.model.n_heads, "kv heads": model.kv_heads(cfg.model)}
        for what, n in heads.items():
            if n % ways:
                raise ConfigError(f"--cp-attention a2a splits the attention heads over cp x tp = {ways} ranks, but "
                                  f"the model has {n} {what}: use --cp-attention allgather, or a cp x tp that "
                                  f"divides {n}")


def head_tail_order(seq_len: int, cp: int) -> torch.Tensor:
    """The sequence's positions in the order the cp ranks hold them: rank 0's two chunks,
    then rank 1's, ... (the order an all-gather over cp returns them in)."""
    if seq_len % (2 * cp):
        raise ConfigError(f"sequence length {seq_len} does not split into 2 x cp = {2 * cp} equal chunks for "
                          f"context parallelism: choose --seq-length a multiple of {2 * cp}")
    chunks = torch.arange(seq_len).chunk(2 * cp)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def chunk_of(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """Rank ``cp_rank``'s part of every ``[batch, seq]`` entry of ``batch``, and its
    ``positions`` (entries of other shapes, e.g. a classifier's labels, are refused)."""
    seq = batch["inputs"].shape[1]
    mine = head_tail_order(seq, cp).view(cp, -1)[cp_rank]
    out = {}
    for key, value in batch.items():
        if value.ndim < 2 or value.shape[1] != seq:
            raise ConfigError(f"context parallelism splits every batch entry along the sequence, but {key!r} has "
                              f"shape {tuple(value.shape)}: it trains language-model objectives only")
        out[key] = value.index_select(1, mine.to(value.device))
    given = batch.get("positions")
    out["positions"] = (given.index_select(1, mine.to(given.device)) if given is not None
                        else mine.to(batch["inputs"].device).expand(batch["inputs"].shape[0], -1).contiguous())
    return out


def attention_work(seq_len: int, cp: int) -> list[int]:
    """Query-key pairs a causal mask allows on each cp rank (its attention FLOPs, up to a
    constant): equal on every rank under the head-tail order."""
    order = head_tail_order(seq_len, cp).view(cp, -1)
    return [int((q + 1).sum()) for q in order]  # query at position p attends to p + 1 keys
