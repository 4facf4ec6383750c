"""Serving a model that spans a mesh: rank 0 answers HTTP, the other ranks follow its requests
(generations, and the scoring of ``logprobs``).

Every rank must run each generation together (the tp collectives, the pp sends), in the same
order. So rank 0's generate function (``Leader``) broadcasts each request, checked first so
that only requests that every rank can serve go out, to the other ranks, which wait in
``follow`` and run the same ``generate_on_mesh`` call; generations run one at a time. While
no request comes, the leader broadcasts a keep-alive every ``keepalive_s`` seconds, so that
the followers' waiting broadcast never runs into the process group's timeout; ``close``
sends the followers home. A client cannot tell the mesh from one device: the tokens are the
same (``tests/test_generation_cli.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch.distributed as dist

from fxmega.inference.generate import check_request
from fxmega.inference.generate_parallel import ModelHolder, generate_on_mesh
from fxmega.inference.scoring import TokenScores, decoder_for, token_scores

_GENERATE, _SCORE, _PING, _STOP = "generate", "score", "ping", "stop"


def score_on_mesh(holder: ModelHolder, sequences: list[list[int]], top: int) -> list[TokenScores]:
    """``scoring.token_scores`` where ``holder``'s parameters are; every rank calls alike."""
    return token_scores(decoder_for(holder), holder.cfg.model, sequences, top)


def _broadcast(message: tuple) -> tuple:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's ``generate_fn`` for the server: each call is run by every rank."""

    def __init__(self, holder: ModelHolder, keepalive_s: float) -> None:
        self.holder, self.keepalive_s = holder, keepalive_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, name="fxmega-serve-keepalive", daemon=True)
        self._thread.start()

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, stop_tokens: Sequence[int] = (), seed: int = 0,
                 on_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
        # refused here, before the followers see it: a request one rank fails would leave the others waiting
        check_request(self.holder.cfg.model, prompts, max_new_tokens, temperature, top_k, top_p)
        kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=list(stop_tokens), seed=seed)
        with self._lock:
            _broadcast((_GENERATE, prompts, max_new_tokens, kwargs))
            # only rank 0 streams: the followers decode the same tokens without a listener
            return generate_on_mesh(self.holder, prompts, max_new_tokens, **kwargs, on_token=on_token)

    def score(self, sequences: list[list[int]], top: int) -> list[TokenScores]:
        """The server's ``score_fn``: each call is run by every rank."""
        for i, seq in enumerate(sequences):  # refused here, as generations are, before the followers see it
            if not 1 <= len(seq) <= self.holder.cfg.model.max_seq_len:
                raise ValueError(f"sequence {i} has {len(seq)} tokens: score 1 to {self.holder.cfg.model.max_seq_len}")
        with self._lock:
            _broadcast((_SCORE, sequences, top))
            return score_on_mesh(self.holder, sequences, top)

    def _keep_alive(self) -> None:
        while not self._closed.wait(self.keepalive_s):
            with self._lock:
                if not self._closed.is_set():
                    _broadcast((_PING,))

    def close(self, timeout_s: float = 5.0) -> bool:
        """Tell the followers to stop (they return from ``follow``); False when they did not
        all hear it within ``timeout_s`` (stopped by the launcher first, say)."""
        self._closed.set()

        def stop() -> None:
            with self._lock:
                _broadcast((_STOP,))

        sender = threading.Thread(target=stop, name="fxmega-serve-stop", daemon=True)
        sender.start()
        sender.join(timeout_s)
        return not sender.is_alive()


def follow(holder: ModelHolder) -> int:
    """A rank other than 0: run every request rank 0 broadcasts until it says stop; the number
    of generations run."""
    served = 0
    while True:
        message = _broadcast(())
        if message[0] == _STOP:
            return served
        if message[0] == _GENERATE:
            _, prompts, max_new_tokens, kwargs = message
            generate_on_mesh(holder, prompts, max_new_tokens, **kwargs)
            served += 1
        if message[0] == _SCORE:
            score_on_mesh(holder, *message[1:])
            served += 1
