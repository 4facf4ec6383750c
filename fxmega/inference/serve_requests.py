"""OpenAI's completion and chat requests, as ``run.py serve`` takes them: each field checked,
with a ``RequestError`` (400, OpenAI's error fields) naming the first bad one and its fix, and
fields this server does not implement refused rather than ignored."""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from fxmega.data.instructions import END, ROLES, prompt_text

MAX_LOGPROBS = 5  # alternatives per position, as OpenAI's completions API allows


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_prompt_tokens: int = 512  # per prompt
    max_new_tokens: int = 256  # the largest max_tokens
    max_context: int | None = None  # prompt + max_tokens (the model's max_seq_len); None: unchecked
    max_prompts: int = 16  # prompts in one list
    max_stop: int = 4  # stop strings, as OpenAI allows
    max_body_bytes: int = 1 << 20


# fields of OpenAI's API this server does not implement, with the values that mean "off" (or null):
# a request asking for them is refused rather than silently answered without them
UNSUPPORTED = {"n": (1,), "best_of": (1,), "suffix": (),
               "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},)}
# fields of OpenAI's chat API beyond the completion API's that this server does not implement
CHAT_UNSUPPORTED = {"tools": (), "tool_choice": (), "functions": (), "function_call": (), "response_format": (),
                    "logprobs": (False,), "top_logprobs": (), "stream_options": ()}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Completion:
    """A validated ``/v1/completions`` request."""

    prompts: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int
    source: str = "prompt"  # the field the prompt came from, for errors about its length
    prompt_ids: list[list[int]] | None = None  # prompts given as token ids (then ``prompts`` is empty)
    echo: bool = False  # the prompt is returned before the completion (and scored with logprobs)
    logprobs: int | None = None  # the returned tokens' log-probabilities, with this many alternatives each
    stream: bool = False  # the text sent as it is generated, as server-sent events


def parse_request(body: Any, limits: Limits) -> Completion:
    """The request's fields, checked; ``RequestError`` (400) naming the first bad one."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(body).__name__}; send "
                                f'{{"prompt": "...", "max_tokens": 16}}')
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in off):  # True is not 1
            raise RequestError(400, f"{name}={json.dumps(body[name])} is not supported by this server; leave "
                                    f"{name} out", name)
    if "prompt" not in body:
        raise RequestError(400, 'prompt is required: a string or a list of strings, e.g. "prompt": "Hello"', "prompt")
    prompts, prompt_ids = _prompts(body["prompt"])
    if len(prompts or prompt_ids) > limits.max_prompts:
        raise RequestError(400, f"prompt is a list of {len(prompts or prompt_ids)} prompts; at most "
                                f"{limits.max_prompts} per request: split it into several requests", "prompt")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError(400, f"echo must be true or false, not {json.dumps(echo)}", "echo")
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream must be true or false, not {json.dumps(stream)}", "stream")
    if stream and (echo or logprobs is not None):
        raise RequestError(400, "stream=true sends the completion's text only: leave echo and logprobs out, or "
                                "stream=false", "stream")
    if stream and len(prompts or prompt_ids) > 1:
        raise RequestError(400, f"stream=true takes one prompt per request, not {len(prompts or prompt_ids)}: send "
                                f"them one by one", "stream")
    # with echo, max_tokens 0 scores the prompt alone (OpenAI allows it)
    max_tokens = _integer(body, "max_tokens", 16, 0 if echo else 1, limits.max_new_tokens)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(400, f"temperature={temperature} must be 0 (greedy) or more", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p={top_p} must be in (0, 1]: 1 keeps every token, 0.9 the most likely "
                                f"ones making 90% of the probability", "top_p")
    top_k = _integer(body, "top_k", 0, 0, None)
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    return Completion(prompts, max_tokens, temperature, top_p, top_k, _stops(body, limits),
                      secrets.randbits(63) if seed is None else seed, prompt_ids=prompt_ids, echo=echo,
                      logprobs=logprobs, stream=stream)


def _prompts(prompt: Any) -> tuple[list[str], list[list[int]] | None]:
    """``prompt`` as texts, or as token ids (OpenAI takes a list of ids, or a list of such
    lists, in place of text): ``(texts, None)`` or ``([], ids)``."""
    if isinstance(prompt, str):
        return [prompt], None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt, None
    is_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if is_ids(prompt):
        return [], [prompt]
    if isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt):
        return [], prompt
    raise RequestError(400, f"prompt must be a string, a non-empty list of strings, a list of token ids or a list "
                            f"of such lists, not {_describe(prompt)}", "prompt")


def parse_chat_request(body: Any, limits: Limits) -> Completion:
    """A chat request as the completion of its conversation: ``messages`` rendered with the
    chat template and followed by the assistant's header, the template's end of message one
    more stop string. Every other field as ``parse_request`` (``max_completion_tokens`` is
    OpenAI's newer name for ``max_tokens``); ``RequestError`` (400) naming the first bad one."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(body).__name__}; send "
                                f'{{"messages": [{{"role": "user", "content": "..."}}]}}')
    for name, off in CHAT_UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in off):
            raise RequestError(400, f"{name}={json.dumps(value)} is not supported by this server; leave {name} out",
                               name)
    if "prompt" in body:
        raise RequestError(400, "prompt is the field of POST /v1/completions; a chat request sends messages: "
                                '[{"role": "user", "content": "..."}]', "prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, f'messages must be a non-empty list of {{"role", "content"}} objects, not '
                                f"{_describe(messages)}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RequestError(400, f"messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": "
                                    f"text}}, not {json.dumps(m)[:80]}", "messages")
    if "max_completion_tokens" in body and "max_tokens" in body:
        raise RequestError(400, "max_tokens and max_completion_tokens are the same limit: give one of them",
                           "max_completion_tokens")
    rest = {k: v for k, v in body.items() if k not in ("messages", "max_completion_tokens", *CHAT_UNSUPPORTED)}
    if "max_completion_tokens" in body:
        rest["max_tokens"] = body["max_completion_tokens"]
    request = parse_request({**rest, "prompt": prompt_text(messages)}, limits)
    return dataclasses.replace(request, stop=[*request.stop, END], source="messages")


def chat_response(completion: dict) -> dict:
    """A ``/v1/completions`` response body as OpenAI's chat completion: each choice's text as
    the assistant's message."""
    choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]}, "logprobs": None,
                "finish_reason": c["finish_reason"]} for c in completion["choices"]]
    return {**completion, "id": "chatcmpl-" + completion["id"].removeprefix("cmpl-"), "object": "chat.completion",
            "choices": choices}


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else f"a list holding {type(value[0]).__name__}"
    return "null" if value is None else type(value).__name__


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name} must be an integer, not {_describe(value)} ({json.dumps(value)})", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"{lo} or more"
        raise RequestError(400, f"{name}={value} must be {bound}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"{name} must be a finite number, not {json.dumps(value)}", name)
    return float(value)


def _stops(body: dict, limits: Limits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a non-empty string or a list of them, not {json.dumps(stop)}", "stop")
    if len(stops) > limits.max_stop:
        raise RequestError(400, f"stop has {len(stops)} strings; at most {limits.max_stop}", "stop")
    return stops
