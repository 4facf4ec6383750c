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

from collections.abc import Sequence

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


@torch.no_grad()
def continuation_logprobs(decoder: Decoder, cfg: ModelConfig, pairs: Sequence[Pair],
                          batch_size: int = 8) -> list[tuple[float, bool]]:
    """For each ``(context, continuation)``: the summed log-probability of the continuation's
    tokens, each given everything before it (the context's end where the two exceed
    ``cfg.max_seq_len``), in float32 from the model's logits; and whether every one of them
    is the most likely token there."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: score at least one request per forward")
    windows = [_window(c, t, cfg.max_seq_len, i) for i, (c, t) in enumerate(pairs)]
    order = sorted(range(len(pairs)), key=lambda i: -len(windows[i]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        inputs = [windows[i][:-1] for i in rows]
        longest = max(map(len, inputs))
        tokens = torch.tensor([[PAD_ID] * (longest - len(x)) + x for x in inputs], dtype=torch.long,
                              device=decoder.device)
        pad = torch.tensor([longest - len(x) for x in inputs], dtype=torch.long, device=decoder.device)
        logits, _ = decoder.forward(tokens, decoder.init_cache(len(rows), longest), 0, pad, longest)
        # the logits may be wider than the vocabulary (padded for tensor parallelism)
        logprobs = torch.log_softmax(logits[..., :cfg.vocab_size].float(), dim=-1)
        for row, i in enumerate(rows):
            targets = torch.tensor(pairs[i][1], dtype=torch.long, device=decoder.device)
            scored = logprobs[row, longest - len(targets):]  # the positions that predict the continuation
            chosen = scored.gather(-1, targets[:, None])[:, 0]
            out[i] = (float(chosen.sum()), bool((scored.argmax(dim=-1) == targets).all()))
    return out
