"""Attention over one block of keys at a time, with its log-sum-exp, and that block's
backward given the whole attention's output and log-sum-exp (flash attention's algebra at
the granularity of a context-parallel chunk, for ring attention).

Attention over keys split into blocks is the blocks' outputs weighted by their softmax
mass: with ``(out_i, lse_i)`` per block, ``lse = logaddexp_i lse_i`` and
``out = sum_i exp(lse_i - lse) out_i`` (``merge``). The backward of one block needs only the
final ``out`` and ``lse`` (``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO out))``), so a
block's scores are recomputed, never kept.

On a CPU the blocks run in torch's fused flash kernel (``_scaled_dot_product_flash_attention
_for_cpu`` and its backward, which take the log-sum-exp in and out): tiled, no scores held.
Elsewhere they are written out here (``fused=False``), which holds one block's scores,
``heads x queries x keys`` in fp32, while it runs: on CUDA, torch's flash and
memory-efficient kernels are the next step (not yet wired: no GPU to test them on here).

Layouts are the model's: ``q [batch, queries, heads, head_dim]``, ``k``, ``v
[batch, keys, kv_heads, head_dim]`` (grouped-query attention: heads a multiple of kv heads);
the log-sum-exp is ``[batch, queries, heads]``. The arithmetic runs in at least float32.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange, reduce, repeat

_aten = torch.ops.aten


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[batch, kv_heads, group, queries, keys]``, scaled, the causal future at -inf."""
    groups = q.shape[2] // k.shape[2]
    qg = rearrange(q, "b l (k g) d -> b k g l d", g=groups).to(_compute_dtype(q))
    s = torch.einsum("bkgld,bskd->bkgls", qg, k.to(qg.dtype)) / math.sqrt(q.shape[-1])
    if causal:  # queries and keys are the same tokens in order
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _heads_first(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``[batch, seq, heads, d]`` as the kernels' ``[batch, heads, seq, d]``, kv heads
    repeated for their query groups."""
    return repeat(x, "b s k d -> b (k g) s d", g=groups)


def _fused(q: torch.Tensor, v: torch.Tensor, fused: bool | None) -> bool:
    # the CPU flash kernel writes outputs as wide as the queries: values of another width (MLA's
    # v_head_dim beside its wider query/key heads) take the einsum form
    if fused is None:
        return q.device.type == "cpu" and v.shape[-1] == q.shape[-1]
    if fused and v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the fused CPU kernel needs values as wide as queries, got {v.shape[-1]} and {q.shape[-1]}")
    return fused


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q`` attending to this block of keys only (``causal``: the block is
    the queries' own tokens). ``fused``: the CPU kernel (default: on a CPU)."""
    if _fused(q, v, fused):
        groups = q.shape[2] // k.shape[2]
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q), _heads_first(k, groups), _heads_first(v, groups), 0.0, causal)
        return rearrange(out, "b h l d -> b l h d"), rearrange(lse, "b h l -> b l h")
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bkgls,bskd->blkgd", (s - lse[..., None]).exp(), v.to(s.dtype))
    return rearrange(out, "b l k g d -> b l (k g) d"), rearrange(lse, "b k g l -> b l (k g)")


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of both parts from each part's ``(out, lse)``."""
    total = torch.logaddexp(lse, block_lse)
    return (out * (lse - total).exp()[..., None] + block_out * (block_lse - total).exp()[..., None]), total


def attend_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                          fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's part of ``(dq, dk, dv)`` (in at least float32), given the whole
    attention's ``out`` (in ``q``'s dtype) and ``lse``."""
    groups = q.shape[2] // k.shape[2]
    dt = _compute_dtype(q)
    if _fused(q, v, fused):
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(grad_out.to(q.dtype)).contiguous(), _heads_first(q), _heads_first(k, groups),
            _heads_first(v, groups), _heads_first(out), rearrange(lse, "b l h -> b h l").contiguous(), 0.0, causal)
        home = "b (k g) s d -> b s k d"  # a kv head's gradient: the sum over its query group
        return (rearrange(dq, "b h l d -> b l h d").to(dt), reduce(dk.to(dt), home, "sum", g=groups),
                reduce(dv.to(dt), home, "sum", g=groups))
    delta = (grad_out.to(dt) * out.to(dt)).sum(-1)
    s = _scores(q, k, causal)
    as_groups = "b l (k g) -> b k g l"
    p = (s - rearrange(lse, as_groups, g=groups)[..., None]).exp()
    dog = rearrange(grad_out, "b l (k g) d -> b k g l d", g=groups).to(dt)
    dv = torch.einsum("bkgls,bkgld->bskd", p, dog)
    dp = torch.einsum("bkgld,bskd->bkgls", dog, v.to(dt))
    ds = p * (dp - rearrange(delta, as_groups, g=groups)[..., None]) / math.sqrt(q.shape[-1])
    dq = torch.einsum("bkgls,bskd->blkgd", ds, k.to(dt))
    dk = torch.einsum("bkgls,bkgld->bskd", ds, rearrange(q, "b l (k g) d -> b k g l d", g=groups).to(dt))
    return rearrange(dq, "b l k g d -> b l (k g) d"), dk, dv
