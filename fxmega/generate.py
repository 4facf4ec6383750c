"""Sampling text from a language model (no KV cache yet: each new token re-runs the model
on the last ``max_seq_len`` tokens, which is fine for the small models trained here)."""

from __future__ import annotations

from collections.abc import Callable

import torch

ForwardFn = Callable[[dict, torch.Tensor], torch.Tensor]


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``logits [batch, vocab]``: greedy at temperature 0."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(forward: ForwardFn, params: dict, prompt: torch.Tensor, max_new_tokens: int, max_seq_len: int,
             temperature: float = 0.8, top_k: int = 0, seed: int = 0) -> torch.Tensor:
    """Extend ``prompt [batch, seq]`` by ``max_new_tokens`` sampled tokens."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = forward(params, tokens[:, -max_seq_len:])[:, -1]
        tokens = torch.cat([tokens, sample_next(logits, temperature, top_k, generator)[:, None]], dim=1)
    return tokens
