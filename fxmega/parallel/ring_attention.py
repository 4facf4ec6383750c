"""Ring attention over context-parallel chunks: keys and values pass around the cp ring,
one rank's chunks per step, and each block's attention is merged into the queries' output
by its log-sum-exp (``fxmega.ops.attention_blocks``); the backward passes them around again
with their gradients, which travel with them back to their owners.

Under the head-tail order rank ``r`` holds chunks ``r`` (head) and ``2 cp - 1 - r`` (tail).
Against rank ``j``'s chunks a causal mask leaves whole blocks: for ``j < r`` every query of
``r`` sees all of ``j``'s head chunk and none of its tail; for ``j > r`` only ``r``'s tail
queries see ``j``, all of both chunks; ``r``'s own chunks are causal in their order. Each
step is then one unmasked block of ``2 c x c`` or ``c x 2 c`` query-key pairs (``c`` tokens
per chunk) on every rank, so the work stays balanced and no mask is ever built.

The next step's keys and values are sent before the current block is computed, so their
transfer can overlap it where the backend runs collectives asynchronously (NCCL); gloo
completes each exchange when it is waited on.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fxmega.ops.attention_blocks import attend_block, attend_block_backward, merge
from fxmega.ops.phases import backward_phase


class Ring(Protocol):
    """This rank's place on the cp ring and the exchange with its neighbours."""

    rank: int
    size: int

    def rotate(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Send ``tensors`` to the next rank, return the previous rank's."""
        ...


def _step_source(ring: Ring, step: int) -> int:
    return (ring.rank - step) % ring.size  # whose chunks this rank holds after ``step`` rotations


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's head-tail chunks ``q [batch, 2c, heads, d]`` over the
    whole sequence, ``k``, ``v [batch, 2c, kv_heads, d]`` (rotary embedding applied)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        c = q.shape[1] // 2
        incoming = ring.rotate(k, v) if ring.size > 1 else None
        out, lse = attend_block(q, k, v, causal=True)  # the own chunks, in order: causal
        for step in range(1, ring.size):
            kj, vj = incoming
            if step + 1 < ring.size:
                incoming = ring.rotate(kj, vj)
            if _step_source(ring, step) < ring.rank:  # every query, the earlier rank's head chunk
                out, lse = merge(out, lse, *attend_block(q, kj[:, :c], vj[:, :c]))
            else:  # the tail queries, both chunks of the later rank
                tail = merge(out[:, c:], lse[:, c:], *attend_block(q[:, c:], kj, vj))
                out, lse = torch.cat([out[:, :c], tail[0]], 1), torch.cat([lse[:, :c], tail[1]], 1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        c = q.shape[1] // 2
        with backward_phase():  # every node of it, or the recompute pass sees disjoint backwards
            dq, dk, dv = attend_block_backward(q, k, v, grad_out, out, lse, causal=True)
            kj, vj = k, v
            for step in range(1, ring.size):
                # the keys, values and their gradients so far move on together: after the
                # last step one more rotation brings each gradient home
                kj, vj, dk, dv = ring.rotate(kj, vj, dk, dv)
                if _step_source(ring, step) < ring.rank:
                    gq, gk, gv = attend_block_backward(q, kj[:, :c], vj[:, :c], grad_out, out, lse)
                    dq = dq + gq
                    dk = torch.cat([dk[:, :c] + gk, dk[:, c:]], 1)
                    dv = torch.cat([dv[:, :c] + gv, dv[:, c:]], 1)
                else:
                    gq, gk, gv = attend_block_backward(q[:, c:], kj, vj, grad_out[:, c:], out[:, c:], lse[:, c:])
                    dq = torch.cat([dq[:, :c], dq[:, c:] + gq], 1)
                    dk, dv = dk + gk, dv + gv
            if ring.size > 1:
                dk, dv = ring.rotate(dk, dv)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring)
