"""Running routed experts: SwiGLU feed-forward networks stacked along a leading expert dim
(``w_gate, w_up [E, d, f]``, ``w_down [E, f, d]``), each token through the ``k`` experts
the router chose, the outputs summed with the router's weights.

Two ways, both one static-shaped graph with no host synchronisation:

- ``dropless``: every token reaches all its experts. The ``T k`` (token, expert) pairs are
  sorted by expert and each expert multiplies its contiguous rows — a grouped matrix product.
  With CUDA and bf16 that is ``torch._grouped_mm`` (the group sizes stay on the device).
  Elsewhere (CPU, fp32, where torch 2.13 has no grouped product with a backward) each
  expert's product is computed for every sorted row and kept where the row is its own:
  exact, static shapes, and ``E`` times the FLOPs — fine for tests and small models,
  the reason to use a GPU or the capacity mode for real ones.
- ``with_capacity``: each expert has a buffer of ``capacity`` rows; a token goes in if its
  expert still has room (first choices before second choices, then in token order, as
  GShard), otherwise that (token, expert) pair is dropped and counted. The experts run as
  one batched product over the ``[E, capacity, d]`` buffers. With capacity at least the
  largest load nothing is dropped and the result equals ``dropless``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fxmega.ops import matmul as matmul_hook


class ExpertOutput(NamedTuple):
    """The combined output ``[T, d]`` and how many (token, expert) pairs were dropped
    (a 0-dim fp32 tensor; always 0 when dropless)."""

    out: torch.Tensor
    dropped: torch.Tensor


def capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Rows per expert buffer: ``ceil(factor * tokens * k / E)`` (Switch Transformer), at least 1."""
    return max(1, math.ceil(factor * tokens * top_k / n_experts))


def _grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_of_row: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [N, a]`` whose rows are sorted by group, times ``w [E, a, b]``: row ``i`` times
    ``w[group_of_row[i]]``. ``ends [E]`` (int32) is where each group's rows end."""
    if _grouped_mm_available(x):
        return matmul_hook.grouped_mm(x, w, ends)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):  # see the module docstring: every expert on every row, kept where it is the row's
        out = torch.where((group_of_row == e).unsqueeze(-1), matmul_hook.matmul(x, w[e], "expert"), out)
    return out


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, mm) -> torch.Tensor:
    return mm(F.silu(mm(x, w_gate)) * mm(x, w_up), w_down)


def dropless(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
             w_up: torch.Tensor, w_down: torch.Tensor) -> ExpertOutput:
    """``x [T, d]`` through the experts ``experts [T, k]`` chose, weighted by ``weights
    [T, k]``; see the module docstring."""
    t, k = experts.shape
    n_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert, tokens in order
    group = flat[order]
    token = order // k
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return grouped_mm(a, w, group, ends)

    y = _swiglu(x[token], w_gate, w_up, w_down, mm)
    y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(x).index_add(0, token, y)
    return ExpertOutput(out, torch.zeros((), device=x.device))


class Dispatch(NamedTuple):
    """Tokens placed in fixed expert buffers (``capacity_dispatch``), and how to bring the
    experts' outputs back to them (``capacity_combine``)."""

    buffers: torch.Tensor  # [E, G * capacity, d]: expert-major, then group, then slot
    row: torch.Tensor  # [G * k * T]: each pair's buffer row (the spare row E * G * capacity if dropped)
    token: torch.Tensor  # [G * k * T]: each pair's token, over the G * T tokens
    gate: torch.Tensor  # [G * k * T]: each pair's routing weight, 0 where dropped
    dropped: torch.Tensor  # 0-dim fp32: pairs over capacity


def _queue_slots(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``experts [G, T, k]``: the pairs' experts in queue order ``[G, k T]`` (first
    choices of every token, then second choices, ...) and each pair's place in its expert's
    queue within its group; a pair is kept when its place is below the capacity."""
    g, t, k = experts.shape
    by_choice = experts.transpose(1, 2).reshape(g, k * t)
    one_hot = F.one_hot(by_choice, n_experts)
    return by_choice, ((one_hot.cumsum(1) - 1) * one_hot).sum(-1)


def capacity_dispatch(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, n_experts: int,
                      capacity_rows: int) -> Dispatch:
    """``x [G, T, d]``'s tokens into ``n_experts`` buffers of ``capacity_rows`` per group:
    within each group a (token, expert) pair goes in if its expert still has room (first
    choices of every token, then second choices, ... in token order, as GShard), else it
    is dropped. ``experts``, ``weights [G, T, k]``."""
    g, t, k = experts.shape
    d = x.shape[-1]
    by_choice, slot = _queue_slots(experts, n_experts)
    kept = slot < capacity_rows
    group = torch.arange(g, device=x.device).unsqueeze(-1)
    # buffers ordered [expert, group, slot]; dropped pairs go to one spare row, thrown away
    spare = n_experts * g * capacity_rows
    row = torch.where(kept, (by_choice * g + group) * capacity_rows + slot, spare).reshape(-1)
    token = (group * t + torch.arange(t, device=x.device).repeat(k)).reshape(-1)
    buffers = x.new_zeros(spare + 1, d).index_add(0, row, x.reshape(g * t, d)[token])
    gate = (weights.transpose(1, 2).reshape(g, k * t) * kept).reshape(-1)
    return Dispatch(buffers[:-1].view(n_experts, g * capacity_rows, d), row, token, gate, (~kept).sum().float())


def capacity_combine(y: torch.Tensor, dispatch: Dispatch, tokens: int) -> torch.Tensor:
    """The experts' outputs ``y [E, G * capacity, d]`` (``dispatch.buffers`` put through
    them) summed back into each of the ``tokens`` (G * T) tokens with its routing weight:
    ``[G * T, d]``."""
    d = y.shape[-1]
    y = torch.cat([y.reshape(-1, d), y.new_zeros(1, d)])[dispatch.row]  # the spare row: zeros
    y = y * dispatch.gate.unsqueeze(-1).to(y.dtype)
    return y.new_zeros(tokens, d).index_add(0, dispatch.token, y)


def stacked_swiglu(buffers: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU on its own buffer: ``buffers [E, rows, d]`` -> ``[E, rows, d]``."""
    return _swiglu(buffers, w_gate, w_up, w_down, lambda x, w: matmul_hook.matmul(x, w, "expert"))


def with_capacity(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, capacity_rows: int) -> ExpertOutput:
    """``dropless`` with fixed expert buffers of ``capacity_rows`` per group of tokens: ``x
    [G, T, d]``, ``experts`` and ``weights [G, T, k]``; within each group, pairs over an
    expert's capacity are dropped (they add nothing to their token's output). A group is a
    sequence in ``fxmega.ops.moe``, so what is dropped does not depend on the batch split."""
    sent = capacity_dispatch(x, experts, weights, w_gate.shape[0], capacity_rows)
    y = stacked_swiglu(sent.buffers, w_gate, w_up, w_down)
    return ExpertOutput(capacity_combine(y, sent, x.shape[0] * x.shape[1]).view_as(x), sent.dropped)
