"""Generating with an encoder–decoder (T5): each source encoded once, then the target decoded
a token at a time over the decoder's self-attention cache, the cross-attention keys and
values computed once per source (``fxmega.models.t5.encode`` / ``decode``).

Sources of different lengths are right-padded and their padding masked, so a source gives
the tokens it would give alone. Sampling is ``fxmega.inference.generate``'s (greedy at
temperature 0, top-k, nucleus; each row from its own seeded generator); a row ends at the
model's EOS or a stop token, which is not returned.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fxmega.inference.generate import check_sampling, cut_at_stops, row_generators, sample_rows
from fxmega.models.family import ModelConfig


class EncoderDecoder(Protocol):
    """What a family needs to generate this way (``fxmega.models.t5``)."""

    def encode(self, params: dict, tokens: torch.Tensor, cfg: ModelConfig,
               valid: torch.Tensor | None = None) -> Any: ...

    def decode(self, params: dict, tokens: torch.Tensor, memory: Any, cfg: ModelConfig,
               cache: Any = None) -> tuple[torch.Tensor, Any]: ...


def is_encoder_decoder(model: object) -> bool:
    return model.is_encoder_decoder


def ended(sources: Sequence[Sequence[int]], eos: int) -> list[list[int]]:
    """Each source ending in EOS, as sources are in training (T5's tokenizer adds it too)."""
    return [list(s) if s and s[-1] == eos else [*s, eos] for s in sources]


def check_request(cfg: ModelConfig, sources: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ``ValueError``, naming the value and the fix, for what cannot be generated."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    for i, source in enumerate(sources):
        if not source:
            raise ValueError(f"source {i} is empty: give at least one token to translate or continue")
        bad = [t for t in source if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"source {i} holds token ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")


@torch.no_grad()
def generate_seq2seq(model: EncoderDecoder, params: dict, cfg: ModelConfig, sources: Sequence[Sequence[int]],
                     max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     stop_tokens: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
    """The target tokens for each source (see the module docstring)."""
    check_request(cfg, sources, max_new_tokens, temperature, top_k, top_p)
    if not sources or max_new_tokens == 0:
        return [[] for _ in sources]
    device = params["embed"]["tokens"].device
    longest = max(len(s) for s in sources)
    tokens = torch.tensor([[int(t) for t in s] + [cfg.pad_id] * (longest - len(s)) for s in sources], device=device)
    valid = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sources], device=device)
    memory = model.encode(params, tokens, cfg, valid)
    stop = {cfg.eos_id, *(int(t) for t in stop_tokens)}
    stop_ids = torch.tensor(sorted(stop), device=device)
    generators = row_generators(seed, range(len(sources)), device)
    nxt = torch.full((len(sources),), cfg.pad_id, dtype=torch.long, device=device)  # T5 starts with pad
    done = torch.zeros(len(sources), dtype=torch.bool, device=device)
    cache, steps = None, []
    for _ in range(max_new_tokens):
        logits, cache = model.decode(params, nxt[:, None], memory, cfg, cache)
        nxt = sample_rows(logits[:, -1, :cfg.vocab_size], temperature, top_k, generators, top_p)
        nxt = nxt.masked_fill(done, cfg.pad_id)
        steps.append(nxt)
        done = done | torch.isin(nxt, stop_ids)
        if bool(done.all()):
            break
    return cut_at_stops(steps, stop)


class WithModelSpecials:
    """A tokenizer that also reads and writes the ids a model adds above the tokenizer's
    vocabulary (T5's specials on a byte or GPT-2 vocabulary) as T5 writes them:
    ``<extra_id_k>`` for sentinel k, ``<pad>``, ``</s>`` (so a prompt can hold the sentinel
    spans to fill); everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, cfg: ModelConfig) -> None:
        self.tokenizer = tokenizer
        names = {cfg.pad_id: "<pad>", cfg.eos_id: "</s>"}
        names |= {cfg.sentinel(k): f"<extra_id_{k}>" for k in range(cfg.n_sentinels)}
        self.names = {i: n for i, n in names.items() if i >= tokenizer.vocab_size}  # the tokenizer's own stay its
        self.ids = {n: i for i, n in self.names.items()}
        self._split = re.compile("(" + "|".join(re.escape(n) for n in self.ids) + ")") if self.ids else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text)
        out: list[int] = []
        for part in self._split.split(text):
            out += [self.ids[part]] if part in self.ids else self.tokenizer.encode(part) if part else []
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], []
        for i in ids:
            if i < self.tokenizer.vocab_size:
                run.append(i)
                continue
            if run:
                out.append(self.tokenizer.decode(run))
                run = []
            out.append(self.names.get(i, f"<id {i}>"))
        if run:
            out.append(self.tokenizer.decode(run))
        return "".join(out)
