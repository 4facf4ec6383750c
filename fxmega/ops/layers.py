"""Pure building blocks of transformer language models.

Functions of tensors and parameters only: no modules, no state, no process groups. Weights
are stored input-dim first (``[in, out]``, GPT-2's Conv1D layout), and attention weights keep
heads as their own dim (``[embed, heads, head_dim]``) so that a sharding rule can split
heads without knowing how they are packed.

Activation layouts use the names batch, seq, embed, heads, kv_heads, head_dim, mlp, vocab.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange

from fxmega.core.errors import ConfigError
from fxmega.ops import kernels
from fxmega.ops.matmul import matmul
from fxmega.ops.rope import Rope, apply_rope
from fxmega.sharding.layout import ContextParallelism, active, context_parallelism, local, shard


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, role: str = "linear") -> torch.Tensor:
    """``x @ w + b`` with ``w`` laid out ``[in, out]`` (the matmul: ``ops.matmul``, which a
    precision recipe may replace; ``role`` as it names them: ``head`` for an output head)."""
    y = matmul(x, w, role)
    return y if b is None else y + b


def project_to_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, seq, embed] x [embed, ..., heads, head_dim] -> [batch, seq, ..., heads, head_dim]``.

    Column-parallel in Megatron's terms when heads are split.
    """
    # tensordot's own lowering (flatten the output dims, one matmul), through the hook
    y = matmul(x, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])
    return y if b is None else y + b


def project_from_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, seq, heads, head_dim] x [heads, head_dim, embed] -> [batch, seq, embed]``.

    Row-parallel in Megatron's terms when heads are split: the result is a partial sum
    until the caller's ``shard`` reduces it.
    """
    # tensordot's own lowering (flatten the contracted dims, one matmul), through the hook
    y = matmul(x.reshape(*x.shape[:-2], -1), w.reshape(-1, w.shape[-1]))
    return y if b is None else y + b


def layer_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (statistics in fp32 whatever the input dtype)."""
    if kernels.active() == "triton":
        return kernels.layer_norm(x, scale, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), scale, bias, eps)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, cast back, then scale (the Hugging Face order,
    which matters in bf16)."""
    if kernels.active() == "triton":
        return kernels.rms_norm(x, scale, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return scale * normed.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: the tanh approximation, not the exact erf form."""
    return F.gelu(x, approximate="tanh")


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    # [batch, queries, keys], True where a query may read a key: earlier or equal positions of
    # its own document, real keys only (document 0 is padding). A padding query reads every
    # earlier real key and itself (never an all-masked row, whose softmax would be NaN; its
    # output is not used). Itself: the same position in the same document, since positions
    # restart in each document of a packed row.
    same = q_doc[:, :, None] == k_doc[:, None, :]
    order = q_pos[:, :, None] >= k_pos[:, None, :]
    readable = order & (k_doc[:, None, :] > 0) & (same | (q_doc[:, :, None] == 0))
    return readable | (same & (q_pos[:, :, None] == k_pos[:, None, :]))


def padded_causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` boolean mask (True: may attend): causal, only to real keys,
    and within each query's document. ``valid [batch, seq]``: 0 for padding, else the
    token's document within its row (1 throughout an unpacked row). Each position may always
    attend to itself, so that a padding query never has an all-masked row."""
    order = torch.arange(valid.shape[-1], device=valid.device).expand(valid.shape)
    return _allowed(order, order, valid, valid)[:, None]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on the ``[batch, seq, heads, head_dim]`` layout that
    every other op keeps: heads go before the sequence for the kernel, and back after."""
    out = F.scaled_dot_product_attention(*(rearrange(t, "batch seq heads dim -> batch heads seq dim")
                                           for t in (q, k, v)), **options)
    return rearrange(out, "batch heads seq dim -> batch seq heads dim")


class Attend(NamedTuple):
    """What attention reads that depends on the step's tokens but not on the layer: built once
    per step (``attend_inputs``) and given to every block, so that no layer rebuilds rotary
    tables or masks, or (under cp) gathers the positions again."""

    chunks: bool  # the tokens are a cp rank's out-of-order chunks: attention goes through the context
    rotary: torch.Tensor | None  # cos, sin stacked: [2, seq, head_dim], or [2, batch, seq, head_dim] at positions
    mask: torch.Tensor | None  # [batch, 1, queries, keys] True where a query may read a key; None: causal in order


IN_ORDER = Attend(False, None, None)  # a batch without padding, in order, without rotary positions


def _chunk_mask(context: ContextParallelism | None, positions: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    # Runs on local chunks: causality from the positions, not the order. Keys are the whole
    # sequence (gathered); queries this rank's chunks, or under a2a the whole sequence too.
    q_pos = k_pos = positions
    q_doc = k_doc = valid
    if context is not None:
        k_pos = context.gather(positions)
        k_doc = context.gather(valid) if valid is not None else None
        if context.mode == "a2a":
            q_pos, q_doc = k_pos, k_doc
    if valid is None:
        return (q_pos[:, :, None] >= k_pos[:, None, :])[:, None]
    return _allowed(q_pos, k_pos, q_doc, k_doc)[:, None]  # padding keys out, within each document


def attend_inputs(seq_len: int, device: torch.device, rope: Rope | None = None, head_dim: int = 0,
                  valid: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> Attend:
    """The step's ``Attend`` for blocks over ``seq_len`` tokens (this rank's, under cp):
    rotary tables when ``rope`` is given (at ``positions``, or at 0..seq_len-1), and the mask
    that padding or packed documents (``valid [batch, seq]``: 0 for padding, else the token's
    document in its row) or out-of-order chunks (``positions [batch, seq]``, each token's place
    in its sequence; in a packed row, in its document) need."""
    if positions is None:
        rotary = None
        if rope is not None:  # a plain table, replicated by ``shard`` to meet split q and k
            rotary = shard(torch.stack(rope.tables(torch.arange(seq_len, device=device), head_dim)), None, None, None)
        mask = None if valid is None else local(padded_causal_mask, (("batch", None),), _MASK_AXES)(valid)
        return Attend(False, rotary, mask)
    context = context_parallelism()
    seq = ("batch", "ctx")
    rotary = None
    if rope is not None:
        def tables(pos: torch.Tensor) -> torch.Tensor:
            return torch.stack(rope.tables(pos, head_dim))
        rotary = local(tables, (seq,), (None, "batch", "ctx", "head_dim"))(positions)
    if context is not None and context.mode == "ring":
        if valid is not None:
            raise ConfigError("--cp-attention ring attends causally over whole chunks and does not mask padding "
                              "or packed documents: use --cp-attention allgather for padded or packed batches")
        return Attend(True, rotary, None)  # causality is the ring's head-tail structure: no mask
    given = (positions,) if valid is None else (positions, valid)
    mask = local(functools.partial(_chunk_mask, context), (seq,) * len(given), _MASK_AXES)(*given)
    return Attend(True, rotary, mask)


def _rotate(q: torch.Tensor, k: torch.Tensor, rotary: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # Each token turned by its own position: elementwise, so it commutes with gathering the
    # keys over cp or exchanging heads, and runs here on this rank's tokens only.
    if rotary is None:
        return q, k
    cos, sin = rotary.unbind(0)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    # Runs on local shards: batch and heads may be split, seq and head_dim are whole. Without
    # padding: is_causal, which the flash kernels take; with it, an explicit mask (the
    # memory-efficient kernels take that on GPUs).
    return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[2] != q.shape[2])


def _attention_across_chunks(context: ContextParallelism | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    # Runs on local shards (heads may be split over tp): this rank's chunks of the sequence.
    # With cp the keys and values of the whole sequence are gathered (allgather), or q, k
    # and v exchanged for head groups of the whole sequence (a2a); causality is the step's
    # mask, built from the positions. The ring passes keys and values around block by block;
    # causality there is the head-tail order's structure, so it has no mask.
    if context is not None and context.mode == "ring":
        return context.ring(q, k, v)
    if context is not None and context.mode == "a2a":
        q, k, v = context.to_heads(q), context.to_heads(k), context.to_heads(v)
    elif context is not None:
        k, v = context.gather(k), context.gather(v)
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=k.shape[2] != q.shape[2])
    return context.from_heads(out) if context is not None and context.mode == "a2a" else out


# Inside attention the sequence is whole (None): batch and heads may be split. Given the
# positions, it is the block's sequence ("ctx": a cp rank's chunks), reached across ranks
# by the context's collectives.
_QKV_AXES = ("batch", None, "heads", "head_dim")
_KV_AXES = ("batch", None, "kv_heads", "head_dim")
_Q_CTX_AXES = ("batch", "ctx", "heads", "head_dim")
_KV_CTX_AXES = ("batch", "ctx", "kv_heads", "head_dim")
_MASK_AXES = ("batch", None, None, None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend = IN_ORDER) -> torch.Tensor:
    """Causal self-attention through SDPA (flash or memory-efficient kernels where the
    device has them). ``q [batch, seq, heads, head_dim]``; ``k``, ``v`` may have fewer
    (grouped) heads. ``attend`` (the step's, from ``attend_inputs``) rotates q and k when it
    has rotary tables and masks padding or out-of-order chunks when it has a mask; with
    ``attend.chunks`` the tokens are a cp rank's chunks and attention reaches the others'."""
    q, k = _rotate(q, k, attend.rotary)
    mask = () if attend.mask is None else (attend.mask,)
    mask_axes = () if attend.mask is None else (_MASK_AXES,)
    if attend.chunks:
        across = functools.partial(_attention_across_chunks, context_parallelism())
        return local(across, (_Q_CTX_AXES, _KV_CTX_AXES, _KV_CTX_AXES) + mask_axes, _Q_CTX_AXES)(q, k, v, *mask)
    return local(_causal_attention, (_QKV_AXES, _KV_AXES, _KV_AXES) + mask_axes, _QKV_AXES)(q, k, v, *mask)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None,
                      vocab_size: int = 0, class_axis: str = "vocab") -> torch.Tensor:
    """Sum over tokens of ``-log softmax(logits)[target]``, computed in fp32.

    Returns a sum, not a mean: the step divides by the token count of the whole global
    batch, so that gradient accumulation and data parallelism give the same loss.

    On logits split over the vocabulary (Megatron's vocab-parallel cross-entropy) it is
    written with reductions and a one-hot match rather than ``gather``: each reduction over
    the vocabulary then becomes a partial result that the sharding layer all-reduces, and the
    full logits are never gathered. On whole logits it is ``F.cross_entropy`` (measured on
    2048 x 50304 fp32 logits, forward and backward, 2 CPU threads: 238 ms compiled and 516 ms
    eager, against 359 and 820 ms for the max / exp-sum / gather form, whose backward is a
    scatter-add, and 253 and 931 ms for the one-hot match).

    ``vocab_size`` smaller than the logits' last dim masks the padding columns (added so
    that tensor parallelism divides the vocabulary) out of the softmax. ``class_axis`` is the
    logical name of the logits' last dim (``classes`` for a classifier's, which no rule splits).
    """
    logits = logits.float()
    vocab_ids = torch.arange(logits.shape[-1], device=targets.device)
    if active() is not None:  # the ids meet the logits where the plan splits them
        vocab_ids = shard(vocab_ids, class_axis)
    if vocab_size and vocab_size < logits.shape[-1]:
        logits = logits.masked_fill(vocab_ids >= vocab_size, float("-inf"))
    if active() is None and not logits.is_meta:  # whole logits: torch's own, fastest eager and compiled (docstring)
        per_token = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    else:
        # split logits; or meta tensors (the planner's traces), where dynamo in torch 2.13 traces
        # autograd.grad through nll_loss as if the loss did not use the parameters
        shift = logits.amax(dim=-1, keepdim=True).detach()  # for stability; the loss does not depend on it
        shifted = logits - shift
        lse = shifted.exp().sum(dim=-1).log()
        # masked_fill, not a product with the one-hot mask: padding columns hold -inf
        target_logit = shifted.masked_fill(vocab_ids != targets.unsqueeze(-1), 0.0).sum(dim=-1)
        per_token = lse - target_logit
    if loss_mask is not None:
        per_token = per_token * loss_mask
    return per_token.sum()


def last_real_token(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``x [batch, seq, d]`` at each row's last position that ``valid`` (1 for tokens, 0 for
    right padding) marks, as ``[batch, 1, d]``; the last position when ``valid`` is None."""
    rows = torch.arange(x.shape[0], device=x.device)
    last = (valid.sum(dim=1) - 1).clamp(min=0) if valid is not None else torch.full_like(rows, x.shape[1] - 1)
    return x[rows, last][:, None]


# ---- decoding with a KV cache -------------------------------------------------------------
# A cache is one (k, v) pair per layer, each ``[batch, max_len, kv_heads, head_dim]`` and
# preallocated for the whole generation. Batched prompts are left-padded, so every row writes
# its new tokens at the same slots (one slice per step, no per-row scatter) while each row keeps
# its own positions (slot minus that row's padding): a prompt then sees exactly the positions
# and keys it would see alone.

KV = tuple[torch.Tensor, torch.Tensor]


class CacheWrite(NamedTuple):
    """What one forward pass over new tokens needs in every layer: where they go in the cache
    (``start``), their positions in their own sequences, and what each may attend to."""

    start: int  # cache slot of the first new token (the same for every row)
    positions: torch.Tensor  # [batch, new] each new token's position in its own sequence
    mask: torch.Tensor  # [batch, 1, new, max_len] True where the query may read the slot
    cos: torch.Tensor | None  # [batch, new, head_dim] rotary tables at ``positions``, or None
    sin: torch.Tensor | None


def cache_write(start: int, new: int, max_len: int, pad: torch.Tensor, head_dim: int = 0,
                rope: Rope | None = None) -> CacheWrite:
    """The ``CacheWrite`` for ``new`` tokens at slots ``[start, start + new)`` of rows whose first
    ``pad[b]`` slots are left padding. A query reads the slots up to its own (causal, and never
    the unwritten ones after it) from the row's first real token on; a padding query also reads
    itself, so that no softmax row is all-masked (NaN). With ``rope`` the rotary tables
    are built once here for all layers."""
    device = pad.device
    slots = torch.arange(start, start + new, device=device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)
    keys = torch.arange(max_len, device=device)
    causal = (keys[None, :] <= slots[:, None])[None]  # [1, new, max_len]
    real = keys[None, None, :] >= pad[:, None, None]  # [batch, 1, max_len]: not left padding
    itself = (keys[None, :] == slots[:, None])[None]  # [1, new, max_len]
    mask = (causal & real) | itself
    cos = sin = None
    if rope is not None:
        cos, sin = rope.tables(positions, head_dim)
    return CacheWrite(start, positions, mask[:, None], cos, sin)


def _attend_over_cache(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    # Runs on local shards: batch and heads may be split, the cache's slots and head_dim are whole.
    return sdpa(q, cache_k.to(q.dtype), cache_v.to(q.dtype), attn_mask=mask, enable_gqa=cache_k.shape[2] != q.shape[2])


# The CacheWrite's tables, by logical name. Under a sharding plan they are plain tensors (built
# from plain ``pad``), and ``shard`` makes them replicated DTensors to meet the split q, k, v.
_ROPE_AXES = ("batch", None, "head_dim")


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KV,
                     write: CacheWrite) -> tuple[torch.Tensor, KV]:
    """Attention of new tokens over a KV cache: ``q [batch, new, heads, head_dim]``, ``k``, ``v``
    with possibly fewer (grouped) heads. Rotates q and k when ``write`` has rotary tables, writes
    k and v into the cache at ``write.start``, and attends over the whole cache under
    ``write.mask``. Returns the output and the new cache; the old one is not modified
    (``slice_scatter`` copies, like JAX's ``dynamic_update_slice``).

    Under a sharding plan (tensor-parallel decoding, ``fxmega.inference.generate_parallel``) q, k, v and
    the cache are split over heads: each rank writes and reads only its own heads' cache, and
    the attention itself runs per shard through ``local``."""
    if write.cos is not None:
        cos, sin = shard(write.cos, *_ROPE_AXES), shard(write.sin, *_ROPE_AXES)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache_k, cache_v = kv
    end = write.start + q.shape[1]
    # split over heads, not slots: under tp each rank writes its own heads, with no communication
    cache_k = torch.slice_scatter(cache_k, k.to(cache_k.dtype), dim=1, start=write.start, end=end)
    cache_v = torch.slice_scatter(cache_v, v.to(cache_v.dtype), dim=1, start=write.start, end=end)
    attend = local(_attend_over_cache, (_QKV_AXES, _KV_AXES, _KV_AXES, _MASK_AXES), _QKV_AXES)
    return attend(q, cache_k, cache_v, shard(write.mask, *_MASK_AXES)), (cache_k, cache_v)
