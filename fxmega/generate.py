"""Sampling text from a language model.

Two generators:

* ``generate(forward, ...)``: no cache; each new token re-runs the model on the last
  ``max_seq_len`` tokens (a sliding window, so any length works). Simple, and fine for the
  small models trained here; ``Run.sample`` uses it.
* ``generate_cached(model, params, cfg, prompts, ...)``: a KV cache per layer (see
  ``layers.cache_write``). The prompts are run once, together (prefill), then one token per
  step attends over the cache: each step costs one token's compute instead of the whole
  sequence's. Prompts of different lengths are left-padded, so that every row writes at the
  same cache slot each step and its next token's logits are always at the last position; each
  row keeps its own positions and never reads the padding, so a prompt gives the tokens it
  would give alone. Prompt plus new tokens must fit in ``cfg.max_seq_len``.

``sample_text`` is ``Run.sample`` on the cached generator: text in, text out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

ForwardFn = Callable[[dict, torch.Tensor], torch.Tensor]

# fed to rows of a batch that have stopped, and placed left of shorter prompts: any valid id
# works, since no real token ever attends to it
PAD_ID = 0


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None, top_p: float = 1.0) -> torch.Tensor:
    """One token per row from ``logits [batch, vocab]``: greedy at temperature 0; otherwise
    softmax of ``logits / temperature`` restricted to the ``top_k`` most likely tokens (0: all)
    and then to the nucleus: the fewest most likely tokens whose probability sums to at least
    ``top_p`` (the most likely token always stays)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the tokens ranked above each one
        drop_ranked = mass_before >= top_p  # the first token has 0 before it: always kept
        drop = torch.zeros_like(drop_ranked).scatter(-1, order, drop_ranked)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(forward: ForwardFn, params: dict, prompt: torch.Tensor, max_new_tokens: int, max_seq_len: int,
             temperature: float = 0.8, top_k: int = 0, seed: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Extend ``prompt [batch, seq]`` by ``max_new_tokens`` sampled tokens (no cache)."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = forward(params, tokens[:, -max_seq_len:])[:, -1]
        tokens = torch.cat([tokens, sample_next(logits, temperature, top_k, generator, top_p)[:, None]], dim=1)
    return tokens


def check_request(cfg: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ``ValueError``, naming the numbers and the fix, for a request the cached generator
    cannot serve: an empty or out-of-vocabulary prompt, bad sampling settings, or a prompt
    that with ``max_new_tokens`` does not fit in ``cfg.max_seq_len``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be 0 or more")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be 0 (greedy) or more")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be 0 (no limit) or more")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; 1 keeps every token")
    limit = cfg.max_seq_len
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        if n == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token to condition on")
        if n + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {n} tokens and max_new_tokens={max_new_tokens}: {n} + {max_new_tokens} = "
                f"{n + max_new_tokens} exceeds max_seq_len={limit}; shorten the prompt to at most "
                f"{max(limit - max_new_tokens, 0)} tokens or lower max_new_tokens to at most {max(limit - n, 0)}")
        bad = [t for t in prompt if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")


@torch.no_grad()
def generate_cached(model: ModuleType, params: dict, cfg: Any, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    stop_tokens: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
    """The new tokens for each prompt, generated with a KV cache by ``model`` (a model module
    such as ``fxmega.models.gpt``: ``init_cache`` and ``decode_forward``).

    Sampling as ``sample_next`` (greedy at temperature 0), from a ``torch.Generator`` seeded
    with ``seed``: the same call gives the same tokens. A sequence ends at the first token in
    ``stop_tokens``, which is not returned; so a list shorter than ``max_new_tokens`` means that
    sequence stopped. Stopped rows are fed padding while the others go on, and their output
    is not extended; generation ends when every row has stopped.
    """
    check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p)
    if not prompts or max_new_tokens == 0:
        return [[] for _ in prompts]
    weight = params["embed"]["tokens"]
    device, dtype = weight.device, weight.dtype
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    pad = torch.tensor([longest - n for n in lengths], dtype=torch.long, device=device)
    tokens = torch.tensor([[PAD_ID] * (longest - len(p)) + [int(t) for t in p] for p in prompts],
                          dtype=torch.long, device=device)
    stop = torch.tensor(sorted({int(t) for t in stop_tokens}), dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.init_cache(cfg, len(prompts), longest + max_new_tokens, dtype, device)

    logits, cache = model.decode_forward(params, tokens, cfg, cache, 0, pad, last_only=True)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    steps = []
    for step in range(max_new_tokens):
        # the logits may be wider than the vocabulary (padded for tensor parallelism)
        nxt = sample_next(logits[:, -1, :cfg.vocab_size], temperature, top_k, generator, top_p)
        nxt = nxt.masked_fill(done, PAD_ID)
        steps.append(nxt)
        done = done | torch.isin(nxt, stop)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        logits, cache = model.decode_forward(params, nxt[:, None], cfg, cache, longest + step, pad, last_only=True)

    stop_set = {int(t) for t in stop_tokens}
    out = []
    for row in torch.stack(steps, dim=1).tolist():
        ended = next((i for i, t in enumerate(row) if t in stop_set), len(row))
        out.append(row[:ended])
    return out


def sample_text(model: ModuleType, params: dict, cfg: Any, tokenizer: Any, prompt: str, max_new_tokens: int,
                temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
                stop_tokens: Sequence[int] = ()) -> str:
    """``prompt`` followed by up to ``max_new_tokens`` generated tokens, decoded: what
    ``Run.sample`` returns, on the cached generator. Like the uncached window, a prompt too long
    to leave room for the new tokens keeps only its last tokens (``max_seq_len -
    max_new_tokens`` of them); ``max_new_tokens`` itself must be below ``max_seq_len``."""
    if max_new_tokens >= cfg.max_seq_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in max_seq_len="
                         f"{cfg.max_seq_len}; ask for at most {cfg.max_seq_len - 1} tokens")
    ids = tokenizer.encode(prompt)
    kept = ids[len(ids) - min(len(ids), cfg.max_seq_len - max_new_tokens):]
    new = generate_cached(model, params, cfg, [kept], max_new_tokens, temperature, top_k, top_p, stop_tokens, seed)
    return tokenizer.decode(ids + new[0])
