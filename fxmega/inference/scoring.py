"""How likely a model finds a text: the log-probability of each continuation given its
context, summed over the continuation's tokens, and whether greedy decoding would have
produced it. This is what evaluation harnesses ask of a language model (lm-evaluation-harness's
``loglikelihood``: ``fxmega.inference.harness``), computed with the model's decoding forward
(``fxmega.inference.generate.Decoder``), so on one device and on a mesh alike: there every
rank calls with the same requests and gets the same answers.

Requests are scored longest first, ``batch_size`` at a time, each batch left-padded to its
longest row (the decoder keeps each row's positions and never attends to the padding, so a
row scores as it would alone); answers come back in the requests' order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fxmega.inference.generate import PAD_ID, Decoder, LocalDecoder
from fxmega.inference.generate_parallel import MeshDecoder
from fxmega.inference.model_loader import LoadedModel
from fxmega.models.family import ModelConfig

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def decoder_for(run: LoadedModel) -> Decoder:
    """The decoding forward over ``run``'s parameters: whole on one device, or this rank's
    shards and stages on its mesh."""
    if run.parallel is None:
        return LocalDecoder(run.model, run.params, run.cfg.model)
    return MeshDecoder(run.model, run.parallel, run.params, run.cfg.model)


def _window(context: Sequence[int], continuation: Sequence[int], limit: int, i: int) -> list[int]:
    """The tokens the model reads for request ``i``: the continuation and as much of the
    context (its end) as fits in ``limit`` positions together, plus the last token, which is
    only predicted."""
    if not continuation:
        raise ValueError(f"request {i}: the continuation is empty; there is nothing to score")
    if not context:
        raise ValueError(f"request {i}: the context is empty; the first token needs something to be predicted from "
                         f"(a harness passes the end-of-text token)")
    if len(continuation) > limit:
        raise ValueError(f"request {i}: the continuation has {len(continuation)} tokens, more than the model's "
                         f"context of {limit} (model.max_seq_len) can score in one window")
    return [*context, *continuation][-(limit + 1):]


def _logprob_batches(decoder: Decoder, cfg: ModelConfig, inputs: Sequence[Sequence[int]],
                     batch_size: int) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The log-softmax of the model's logits over each input (float32, ``[rows, longest, vocab]``,
    each row left-padded to the batch's longest), for the inputs in batches of ``batch_size``,
    longest first: the batch's input indices and their log-probabilities."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: score at least one request per forward")
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        longest = max(len(inputs[i]) for i in rows)
        tokens = torch.tensor([[PAD_ID] * (longest - len(inputs[i])) + [int(t) for t in inputs[i]] for i in rows],
                              dtype=torch.long, device=decoder.device)
        pad = torch.tensor([longest - len(inputs[i]) for i in rows], dtype=torch.long, device=decoder.device)
        logits, _ = decoder.forward(tokens, decoder.init_cache(len(rows), longest), 0, pad, longest)
        # the logits may be wider than the vocabulary (padded for tensor parallelism)
        yield rows, torch.log_softmax(logits[..., :cfg.vocab_size].float(), dim=-1)


@torch.no_grad()
def continuation_logprobs(decoder: Decoder, cfg: ModelConfig, pairs: Sequence[Pair],
                          batch_size: int = 8) -> list[tuple[float, bool]]:
    """For each ``(context, continuation)``: the summed log-probability of the continuation's
    tokens, each given everything before it (the context's end where the two exceed
    ``cfg.max_seq_len``), in float32 from the model's logits; and whether every one of them
    is the most likely token there."""
    windows = [_window(c, t, cfg.max_seq_len, i) for i, (c, t) in enumerate(pairs)]
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    for rows, logprobs in _logprob_batches(decoder, cfg, [w[:-1] for w in windows], batch_size):
        for row, i in enumerate(rows):
            targets = torch.tensor(pairs[i][1], dtype=torch.long, device=decoder.device)
            scored = logprobs[row, logprobs.shape[1] - len(targets):]  # the positions that predict the continuation
            chosen = scored.gather(-1, targets[:, None])[:, 0]
            out[i] = (float(chosen.sum()), bool((scored.argmax(dim=-1) == targets).all()))
    return out


@dataclass(frozen=True)
class TokenScores:
    """A sequence's tokens after its first, as the model scores them: each one's
    log-probability given the tokens before it, and the ``top`` most likely tokens there
    (id, log-probability), most likely first."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@torch.no_grad()
def token_scores(decoder: Decoder, cfg: ModelConfig, sequences: Sequence[Sequence[int]], top: int = 1,
                 batch_size: int = 8) -> list[TokenScores]:
    """``TokenScores`` of each sequence (at most ``cfg.max_seq_len`` tokens): what OpenAI's
    completions API returns as ``logprobs`` (``top_logprobs`` with ``top`` alternatives)."""
    for i, seq in enumerate(sequences):
        if not 1 <= len(seq) <= cfg.max_seq_len:
            raise ValueError(f"sequence {i} has {len(seq)} tokens: score 1 to {cfg.max_seq_len} (model.max_seq_len)")
    out: list[TokenScores] = [TokenScores([], [])] * len(sequences)  # a single token has nothing to score
    scorable = [i for i, seq in enumerate(sequences) if len(seq) > 1]
    for rows, logprobs in _logprob_batches(decoder, cfg, [sequences[i][:-1] for i in scorable], batch_size):
        for row, j in enumerate(rows):
            seq = sequences[scorable[j]]
            scored = logprobs[row, logprobs.shape[1] - (len(seq) - 1):]
            targets = torch.tensor(seq[1:], dtype=torch.long, device=decoder.device)
            values, ids = scored.topk(min(top, scored.shape[-1]), dim=-1)
            out[scorable[j]] = TokenScores(scored.gather(-1, targets[:, None])[:, 0].tolist(),
                                           [list(zip(a, b)) for a, b in zip(ids.tolist(), values.tolist())])
    return out
