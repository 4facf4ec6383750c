"""A decoder-only model tuned on the chat template (``fxmega.data.instructions``) answering
messages: each message is the user's turn of a one-turn conversation, the answer is what the
model writes in the assistant's turn, greedily, up to the template's end of message. Used to
evaluate translation and question answering; ``run.py serve`` answers whole conversations
the same way (``/v1/chat/completions``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fxmega.data.instructions import END, prompt_text
from fxmega.inference.generation_cli import generate_texts
from fxmega.inference.model_loader import LoadedModel

Answerer = Callable[[Sequence[str]], list[str]]


def chat_answerer(run: LoadedModel, max_new_tokens: int, batch_size: int = 32) -> Answerer:
    """Greedy answers of ``run``'s model to each message as the user's, cut at the template's
    end of message. The prompt and the answer share the model's context: a prompt longer than
    half of it has its message cut (as training cuts samples), and each batch generates at most
    what is left."""
    tok, limit = run.tokenizer, run.cfg.model.max_seq_len

    def prompt(message: str) -> str:
        text = prompt_text([{"role": "user", "content": message}])
        over = len(tok.encode(text)) - limit // 2
        if over > 0:
            ids = tok.encode(message)
            text = prompt_text([{"role": "user", "content": tok.decode(ids[:max(len(ids) - over, 1)])}])
        return text

    def answer(messages: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(messages), batch_size):
            prompts = [prompt(m) for m in messages[i:i + batch_size]]
            room = limit - max(len(tok.encode(p)) for p in prompts)
            out += generate_texts(run, prompts, min(max_new_tokens, room), 0.0, 0, 1.0, [END], 0)
        return out
    return answer
