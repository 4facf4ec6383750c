"""Generating tokens with a KV cache: one loop for every mesh.

``decode(decoder, cfg, prompts, ...)`` is the loop: request checks, left padding, one prefill
of every prompt together, then one token per step attending over the cache, sampling, stop
tokens. Prompts of different lengths are left-padded, so that every row writes at the same
cache slot each step and its next token's logits are always at the last position; each row
keeps its own positions and never reads the padding, so a prompt gives the tokens it would
give alone. Prompt plus new tokens must fit in ``cfg.max_seq_len``.

A ``Decoder`` is the model's forward by pieces while decoding
(``fxmega.models.pieces.decode_pieces``) wherever its parameters are: ``LocalDecoder`` on one
device; ``fxmega.inference.generate_parallel.MeshDecoder`` split over tp and staged over pp. Every
decoder returns the same full logits on every rank, so every rank samples the same token
from the same seeded generator without a broadcast. ``generate_cached(model, params, cfg,
...)`` is the loop on one device; ``sample_text`` is text in, text out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fxmega.models.family import ModelConfig, ModelFamily
from fxmega.models.pieces import blocks_of, decode_pieces, init_cache
from fxmega.ops import layers

Cache = dict[int, layers.KV]  # global block index -> (keys, values)
GenerateFn = Callable[..., list[list[int]]]  # (prompts, max_new_tokens, temperature, ...) -> new ids per prompt

# fed to rows of a batch that have stopped, and placed left of shorter prompts: any valid id
# works, since no real token ever attends to it
PAD_ID = 0


class Decoder(Protocol):
    """A model's forward while decoding, wherever its parameters are."""

    dtype: torch.dtype  # of the cache and the activations
    device: torch.device

    def init_cache(self, batch: int, max_len: int) -> Cache: ...

    def forward(self, tokens: torch.Tensor, cache: Cache, start: int, pad: torch.Tensor, max_len: int,
                last_only: bool = False) -> tuple[torch.Tensor, Cache]:
        """Logits ``[batch, new or 1, >= vocab]`` (a plain tensor, the same on every rank) for
        ``tokens [batch, new]`` written at cache slots ``[start, start + new)``; ``pad [batch]``
        counts each row's left padding. ``cache`` itself is unchanged."""
        ...


class LocalDecoder:
    """The forward by pieces over parameters held whole on this device."""

    def __init__(self, model: ModelFamily, params: dict, cfg: ModelConfig) -> None:
        self.model, self.params, self.cfg = model, params, cfg
        weight = params["embed"]["tokens"]
        self.dtype, self.device = weight.dtype, weight.device

    def init_cache(self, batch: int, max_len: int) -> Cache:
        return init_cache(self.model, self.cfg, [i for i, _ in blocks_of(self.params)], batch, max_len, self.dtype,
                          self.device)

    def forward(self, tokens: torch.Tensor, cache: Cache, start: int, pad: torch.Tensor, max_len: int,
                last_only: bool = False) -> tuple[torch.Tensor, Cache]:
        write = self.model.decode_write(self.cfg, start, tokens.shape[1], max_len, pad)
        return decode_pieces(self.model, self.params, tokens, self.cfg, cache, write, last_only=last_only)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None, top_p: float = 1.0) -> torch.Tensor:
    """One token per row from ``logits [batch, vocab]``: greedy at temperature 0; otherwise
    softmax of ``logits / temperature`` restricted to the ``top_k`` most likely tokens (0: all)
    and then to the nucleus: the fewest most likely tokens whose probability sums to at least
    ``top_p`` (the most likely token always stays)."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or below fp32's normals: greedy, the limit
        return logits.argmax(dim=-1)
    # shifted so that the largest is 0 before dividing: the same softmax, and a tiny temperature
    # gives 0 and -inf (greedy, as its limit) rather than inf - inf = NaN
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the tokens ranked above each one
        drop_ranked = mass_before >= top_p
        drop_ranked[..., 0] = False  # the most likely token always stays (a top_p that rounds to 0 in fp32 too)
        drop = torch.zeros_like(drop_ranked).scatter(-1, order, drop_ranked)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def row_generators(seed: int, rows: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One generator per request row, seeded from ``seed`` and the row's index in the request:
    a row draws the same tokens whichever other rows share its batch (so data-parallel ranks
    that each decode a share of the rows sample what one device samples)."""
    # kept below 2**63: a server's random seed may use the whole 64 bits
    return [torch.Generator(device=device).manual_seed((seed * 1_000_003 + row) % 2**63) for row in rows]


def sample_rows(logits: torch.Tensor, temperature: float, top_k: int, generators: Sequence[torch.Generator],
                top_p: float = 1.0) -> torch.Tensor:
    """``sample_next`` for each row of ``logits [batch, vocab]`` from that row's generator."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.cat([sample_next(logits[i:i + 1], temperature, top_k, g, top_p) for i, g in enumerate(generators)])


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Raise ``ValueError``, naming the value and the fix, for settings no generator can use."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be 0 or more")
    if not temperature >= 0 or math.isinf(temperature):  # NaN fails the comparison
        raise ValueError(f"temperature={temperature} must be 0 (greedy) or a finite positive number")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be 0 (no limit) or more")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; 1 keeps every token")


def cut_at_stops(steps: Sequence[torch.Tensor], stops: set[int]) -> list[list[int]]:
    """Each row of the sampled ``steps`` (one ``[batch]`` tensor per step) up to its first
    stop token, which is not kept."""
    out = []
    for row in torch.stack(list(steps), dim=1).tolist():
        out.append(row[:next((i for i, t in enumerate(row) if t in stops), len(row))])
    return out


def check_request(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ``ValueError``, naming the numbers and the fix, for a request the cached generator
    cannot serve: an empty or out-of-vocabulary prompt, bad sampling settings, or a prompt
    that with ``max_new_tokens`` does not fit in ``cfg.max_seq_len``."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
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
def decode(decoder: Decoder, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
           seed: int = 0, rows: Sequence[int] | None = None,
           on_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
    """The new tokens for each prompt, generated with ``decoder``'s KV cache.

    Sampling as ``sample_next`` (greedy at temperature 0), each row from its own generator
    seeded with ``seed`` and the row's index in the request (``rows``: the prompts' indices,
    when they are a share of a larger request): the same call gives the same tokens. A
    sequence ends at the first token in ``stop_tokens``, which is not returned; so a list
    shorter than ``max_new_tokens`` means that sequence stopped. Stopped rows are fed padding
    while the others go on, and their output is not extended; generation ends when every row
    has stopped. On a mesh every rank calls with the same arguments and returns the same
    tokens. ``on_token``, when given, hears each step's token of every row as it is sampled (a
    stopped row's padding included: the caller knows which rows stopped), for streaming.
    """
    check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p)
    if not prompts or max_new_tokens == 0:
        return [[] for _ in prompts]
    device = decoder.device
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    total = longest + max_new_tokens
    pad = torch.tensor([longest - n for n in lengths], dtype=torch.long, device=device)
    tokens = torch.tensor([[PAD_ID] * (longest - len(p)) + [int(t) for t in p] for p in prompts],
                          dtype=torch.long, device=device)
    stop = torch.tensor(sorted({int(t) for t in stop_tokens}), dtype=torch.long, device=device)
    generators = row_generators(seed, range(len(prompts)) if rows is None else rows, device)
    cache = decoder.init_cache(len(prompts), total)

    logits, cache = decoder.forward(tokens, cache, 0, pad, total, last_only=True)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    steps = []
    for step in range(max_new_tokens):
        # the logits may be wider than the vocabulary (padded for tensor parallelism)
        nxt = sample_rows(logits[:, -1, :cfg.vocab_size], temperature, top_k, generators, top_p)
        nxt = nxt.masked_fill(done, PAD_ID)
        steps.append(nxt)
        if on_token is not None:
            on_token(nxt.tolist())
        done = done | torch.isin(nxt, stop)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        logits, cache = decoder.forward(nxt[:, None], cache, longest + step, pad, total, last_only=True)

    return cut_at_stops(steps, {int(t) for t in stop_tokens})


def generate_cached(model: ModelFamily, params: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    stop_tokens: Sequence[int] = (), seed: int = 0,
                    on_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
    """``decode`` on one device, over ``model``'s (a family such as ``fxmega.models.gpt.FAMILY``) whole
    parameters."""
    return decode(LocalDecoder(model, params, cfg), cfg, prompts, max_new_tokens, temperature, top_k, top_p,
                  stop_tokens, seed, on_token=on_token)


def sample_text(generate_fn: GenerateFn, cfg: ModelConfig, tokenizer: Any, prompt: str, max_new_tokens: int,
                temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
                stop_tokens: Sequence[int] = ()) -> str:
    """``prompt`` followed by up to ``max_new_tokens`` tokens from ``generate_fn`` (``decode``
    bound to a decoder, or ``generate_on_mesh`` bound to a model), decoded: what
    ``Run.sample`` returns.

    What fits in the model's context (``cfg.max_seq_len``) is one call. A longer text is
    generated in windows, as a sliding window would: each call conditions on the last tokens
    so far (at least half the context) and adds at most the other half, its cache and
    positions starting afresh; window ``i`` samples with ``seed + i``. A prompt too long for
    its window keeps only its last tokens."""
    window, keep = cfg.max_seq_len, cfg.max_seq_len // 2
    out = tokenizer.encode(prompt)
    left, rounds = max_new_tokens, 0
    while left > 0:
        n = left if len(out) + left <= window else min(left, window - keep)
        new = generate_fn([out[-(window - n):]], n, temperature=temperature, top_k=top_k, top_p=top_p,
                          stop_tokens=stop_tokens, seed=seed + rounds)[0]
        out, left, rounds = out + new, left - len(new), rounds + 1
        if len(new) < n:  # a stop token
            break
    return tokenizer.decode(out)
