"""Where a completion ends in text: the stop strings that are one token each (so that
generation itself stops at them), the text cut before the first stop string (OpenAI's
semantics: the stop string is not returned), and ``TextStream``, the same cut applied while
tokens arrive, for streaming. Used by the server, ``run.py generate``, the harness and the
recipes' evaluations."""

from __future__ import annotations

from collections.abc import Sequence

from fxmega.data.tokenizer import Tokenizer


class TextStream:
    """A completion's text as its tokens arrive, released only where no later token can change
    it: not a character whose bytes are still coming (a trailing replacement character is held
    back until the end), not the start of what may become a stop string; nothing after a stop
    string or a stop token."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], stop_tokens: Sequence[int]) -> None:
        self.tokenizer, self.stops, self.stop_tokens = tokenizer, list(stops), set(stop_tokens)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The text ``token`` makes safe to send (often empty)."""
        if self.stopped:
            return ""
        if token in self.stop_tokens:
            self.stopped = True
            return self.finish()
        self.ids.append(token)
        text, cut = cut_at_stop(self.tokenizer.decode(self.ids), self.stops)
        if cut:
            self.stopped = True
            return self._release(text)
        held = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        safe = text[:len(text) - held].rstrip("\ufffd")
        return self._release(safe)

    def finish(self) -> str:
        """The rest of the text, once generation has ended."""
        return self._release(cut_at_stop(self.tokenizer.decode(self.ids), self.stops)[0])

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def stop_token_ids(tokenizer: Tokenizer, stops: Sequence[str]) -> list[int]:
    """Ids that end a sequence during generation: the stop strings that are one token each,
    and the tokenizer's end-of-document id."""
    ids = [ids[0] for s in stops if len(ids := tokenizer.encode(s)) == 1]
    eod = getattr(tokenizer, "eod", None)
    return ids + ([eod] if eod is not None else [])


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` before the earliest stop string, and whether one was found."""
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[:min(found)], True) if found else (text, False)
