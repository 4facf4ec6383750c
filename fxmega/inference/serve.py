"""A small HTTP completion server on the standard library (``http.server``, no dependencies).

``POST /v1/completions`` takes and answers OpenAI's text-completion JSON, ``POST
/v1/chat/completions`` OpenAI's chat JSON (the conversation rendered with fxmega's chat
template, ``fxmega.data.instructions``, and answered in the assistant's turn up to the
template's end of message); ``GET /v1/models`` lists the one served model (so that OpenAI's
clients find it), and ``GET /health`` says the server is up. A completion request may give its
prompt as token ids, and ask for ``echo`` (the prompt returned before the completion) and
``logprobs`` (each returned token's log-probability and its ``logprobs`` most likely
alternatives, from ``score_fn``: ``fxmega.inference.scoring.token_scores``), which is how
lm-evaluation-harness's ``local-completions`` model scores a task against a server; ``GET
/tokenizer_info``, ``POST /tokenize`` and ``POST /detokenize`` give it the served tokenizer, as
vLLM's server does. ``stream: true`` (completions and chat) sends the text as OpenAI streams it,
server-sent events of chunks released as no later token can change them (``TextStream``), the
finish reason last, then ``data: [DONE]``. The model is any
``generate_fn(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed) -> new
tokens per prompt``; for an fxmega model that is ``functools.partial(generate_cached, model,
params, cfg)``, which stops at a stop token without returning it (see ``fxmega.inference.generate``)::

    server = serve(partial(generate_cached, gpt, params, cfg), ByteTokenizer(), port=8000,
                   max_context=cfg.max_seq_len)
    ...
    server.stop()

Status codes: 400 for a body that is not JSON or a field that is missing, ill-typed or out of
range, including a prompt longer than ``max_prompt_tokens`` or one that leaves no room for
``max_tokens`` in the model's context (400, as OpenAI answers context-length errors: the
request is well-formed bytes with a wrong value, while 413 is about the body's size), and for a
lone UTF-16 surrogate or nesting too deep to parse; 404 for a model other than the served one
(OpenAI's ``model_not_found``) and for an unknown path, 405 for a method the path does not
take; 411 without a Content-Length; 413 for a body over ``max_body_bytes``; 500 when the
generator fails. Every error body is ``{"error": {"message", "type", "param", "code"}}`` with a
message naming the field and the fix.

Stop strings: each one that is a single token also stops generation early; all of them are
matched on the decoded text, which is cut before the first match (OpenAI's semantics: the
stop string is not returned). The tokenizer's end-of-document id, when it has one, stops too.
Generations run one at a time (a lock), so concurrent requests queue instead of competing for
the device's memory.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn
from urllib.parse import urlsplit

from fxmega.data.tokenizer import Tokenizer
from fxmega.inference.scoring import TokenScores
from fxmega.inference.serve_requests import (
    Completion,
    Limits,
    RequestError,
    chat_response,
    parse_chat_request,
    parse_request,
)
from fxmega.inference.stops import TextStream, cut_at_stop, stop_token_ids

GenerateFn = Callable[..., list[list[int]]]
STOP_ERROR = {"error": {"message": "the server is stopping: this stream was cut before its end",
                        "type": "server_shutdown", "param": None, "code": None}}


STOP_DRAIN_S = 30.0  # seconds a stopping server gives the requests in flight to finish


class Cut(Exception):
    """Raised from a stream's token callback when the stopping server's drain time is up."""
ScoreFn = Callable[[list[list[int]], int], list[TokenScores]]  # (sequences, top) -> scores: scoring.token_scores


# a body this much over the limit is still read (and dropped) before answering 413, so the
# client sees the answer rather than a connection reset; beyond it the connection is just closed
DRAIN_FACTOR = 16
DEFAULT_LIMITS = Limits()


class CompletionServer(ThreadingHTTPServer):
    """The HTTP server: ``start()`` serves from a daemon thread, ``stop()`` shuts it down."""

    daemon_threads = True  # a hung client never keeps the process alive

    def __init__(self, generate_fn: GenerateFn, tokenizer: Tokenizer, host: str = "127.0.0.1", port: int = 0,
                 limits: Limits = DEFAULT_LIMITS, model_name: str = "fxmega", log_requests: bool = False,
                 score_fn: ScoreFn | None = None) -> None:
        super().__init__((host, port), _Handler)
        self.generate_fn, self.tokenizer, self.limits, self.score_fn = generate_fn, tokenizer, limits, score_fn
        self.model_name, self.log_requests = model_name, log_requests
        self.started = int(time.time())  # GET /v1/models' "created"
        self._generating = threading.Lock()
        self._thread: threading.Thread | None = None
        # requests accepted and not yet answered, so that a stop can let them finish
        self._in_flight = 0
        self._idle = threading.Condition()
        self.cutting = threading.Event()  # set when a stop's drain time is up: streams end early

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> CompletionServer:
        self._thread = threading.Thread(target=self.serve_forever, name="fxmega-serve", daemon=True)
        self._thread.start()
        return self

    def process_request(self, request: Any, client_address: Any) -> None:
        # counted here, in serve_forever's thread, before the handler's thread exists: a stop
        # that follows sees every request it accepted
        with self._idle:
            self._in_flight += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._answered()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._answered()

    def _answered(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _wait_idle(self, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        with self._idle:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return self._in_flight

    def stop(self, drain_s: float = 0.0, cut_s: float = 5.0) -> int:
        """Stop accepting requests (waits for ``serve_forever`` to return), let those in flight
        finish for up to ``drain_s``, then end the streams still running (their last chunk and
        an error event) and wait up to ``cut_s`` more (``cut_s`` 0: none is cut, as on a mesh,
        where rank 0 leaving a generation would strand the ranks following it); close the
        socket. Returns how many requests were still unanswered."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        left = self._wait_idle(drain_s)
        if left and cut_s > 0:
            self.cutting.set()
            left = self._wait_idle(cut_s)
        self.server_close()
        return left

    def encode(self, request: Completion) -> list[list[int]]:
        """The request's prompts as token ids, each checked against the limits and the model's
        context; ``RequestError`` (400) naming the first that does not fit."""
        tok, limits = self.tokenizer, self.limits
        if request.logprobs is not None and self.score_fn is None:
            raise RequestError(400, "logprobs: the served model is not scored token by token here (a decoder-only "
                                    "model is; an encoder-decoder is not); leave logprobs out", "logprobs")
        encoded = request.prompt_ids or [tok.encode(p) for p in request.prompts]
        vocab = tok.vocab_size
        for i, ids in enumerate(encoded):
            name = request.source if len(encoded) == 1 else f"{request.source}[{i}]"
            name += " (with the chat template)" if request.source == "messages" else ""
            if not ids:
                raise RequestError(400, f"{name} encodes to no tokens: give some text to continue", request.source)
            if request.prompt_ids is not None and not all(0 <= t < vocab for t in ids):
                raise RequestError(400, f"{name} holds token ids outside the tokenizer's vocabulary [0, {vocab})",
                                   request.source)
            if len(ids) > limits.max_prompt_tokens:
                raise RequestError(400, f"{name} is {len(ids)} tokens, more than the {limits.max_prompt_tokens} "
                                        f"this server takes: shorten it", request.source,
                                   code="context_length_exceeded")
            if limits.max_context is not None and len(ids) + request.max_tokens > limits.max_context:
                room = limits.max_context - len(ids)
                raise RequestError(400, f"{name} ({len(ids)} tokens) + max_tokens ({request.max_tokens}) = "
                                        f"{len(ids) + request.max_tokens} exceeds the model's context of "
                                        f"{limits.max_context} tokens: lower max_tokens to at most {room} or "
                                        f"shorten the {request.source}", "max_tokens",
                                   code="context_length_exceeded")
        return encoded

    def complete(self, request: Completion) -> dict:
        """The response body for a validated request."""
        tok = self.tokenizer
        encoded = self.encode(request)
        stop_tokens = stop_token_ids(tok, request.stop)
        with self._generating:
            try:
                outs = [[] for _ in encoded] if request.max_tokens == 0 else self.generate_fn(
                    encoded, request.max_tokens, temperature=request.temperature, top_k=request.top_k,
                    top_p=request.top_p, stop_tokens=stop_tokens, seed=request.seed)
                scores = None if request.logprobs is None else self.score_fn(
                    [p + o for p, o in zip(encoded, outs)], max(request.logprobs, 1))
            except ValueError as e:  # the generator's own check of the request
                raise RequestError(400, str(e)) from None
        choices, completion_tokens = [], 0
        for i, ids in enumerate(outs):
            # the stop token was generated, not returned (max_tokens 0: nothing was generated)
            ended_at_token = 0 < request.max_tokens and len(ids) < request.max_tokens
            text, cut = cut_at_stop(tok.decode(ids), request.stop)
            prompt_text = tok.decode(encoded[i]) if request.prompt_ids is not None else request.prompts[i]
            logprobs = None if scores is None else self._logprobs(encoded[i], ids, scores[i], request, prompt_text)
            choices.append({"index": i, "text": prompt_text + text if request.echo else text, "logprobs": logprobs,
                            "finish_reason": "stop" if cut or ended_at_token else "length"})
            completion_tokens += len(ids) + int(ended_at_token)
        prompt_tokens = sum(map(len, encoded))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


    def stream(self, request: Completion, send: Callable[[str, str | None], None]) -> None:
        """Generate the one prompt of a validated ``request``, calling ``send(text, None)`` with
        each piece of the completion's text as soon as no later token can change it, and
        ``send("", finish_reason)`` at the end."""
        (ids,) = self.encode(request)
        stop_tokens = stop_token_ids(self.tokenizer, request.stop)
        text = TextStream(self.tokenizer, request.stop, stop_tokens)

        def on_token(step: list[int]) -> None:
            if self.cutting.is_set():
                raise Cut
            piece = text.add(step[0])
            if piece:
                send(piece, None)

        with self._generating:
            try:
                new = self.generate_fn([ids], request.max_tokens, temperature=request.temperature,
                                       top_k=request.top_k, top_p=request.top_p, stop_tokens=stop_tokens,
                                       seed=request.seed, on_token=on_token)[0]
            except ValueError as e:  # the generator's own check of the request
                raise RequestError(400, str(e)) from None
        piece = text.finish()
        if piece:
            send(piece, None)
        send("", "stop" if text.stopped or len(new) < request.max_tokens else "length")

    def _logprobs(self, prompt: list[int], new: list[int], scores: TokenScores, request: Completion,
                  prompt_text: str) -> dict:
        """OpenAI's ``logprobs`` of one choice: the returned tokens (the prompt's too with echo,
        its first unscored: ``null``), each one's log-probability and the ``request.logprobs``
        most likely tokens at its position (tokens that decode to the same text keep the
        likelier), and where each token's text starts in the choice's text."""
        tok = self.tokenizer
        ids = prompt + new if request.echo else new
        logprobs = [None, *scores.logprobs] if request.echo else scores.logprobs[len(prompt) - 1:]
        tops = [None, *scores.top] if request.echo else scores.top[len(prompt) - 1:]
        texts = [tok.decode([t]) for t in ids]
        offsets, at = [], 0 if request.echo else len(prompt_text)
        for text in texts:
            offsets.append(at)
            at += len(text)
        top_logprobs = []
        for top in tops:
            if top is None:
                top_logprobs.append(None)
                continue
            alternatives: dict[str, float] = {}
            for token, logprob in top[:request.logprobs]:
                alternatives.setdefault(tok.decode([token]), logprob)
            top_logprobs.append(alternatives)
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    server_version = "fxmega-serve"
    timeout = 60  # seconds a client may stall mid-request before its thread gives up
    streaming = False  # set once a stream's headers are out: an error then goes as an event

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def _route(self, method: str) -> None:
        routes: dict[str, dict[str, Callable[[], dict | None]]] = {
            "/health": {"GET": lambda: {"status": "ok", "model": self.server.model_name}},
            "/v1/models": {"GET": lambda: {"object": "list", "data": [self._model_card()]}},
            f"/v1/models/{self.server.model_name}": {"GET": self._model_card},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
            # the tokenizer, as vLLM's server offers it (lm-eval's local-completions reads it remotely)
            "/tokenizer_info": {"GET": self._tokenizer_info},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
        }
        path = urlsplit(self.path).path
        try:
            if path.startswith("/v1/models/") and path not in routes:
                self._drain(self._content_length(required=False))
                self._unknown_model(path.removeprefix("/v1/models/"))
            if path not in routes:
                self._drain(self._content_length(required=False))
                raise RequestError(404, f"no such path {path}: use POST /v1/completions, POST "
                                        f"/v1/chat/completions, GET /v1/models or GET /health",
                                   kind="not_found_error")
            if method not in routes[path]:
                self._drain(self._content_length(required=False))
                allowed = ", ".join(routes[path])
                raise RequestError(405, f"{method} is not allowed on {path}: use {allowed}",
                                   kind="method_not_allowed")
            answer = routes[path][method]()
            if answer is not None:  # None: streamed already
                self._send(200, answer)
        except RequestError as e:
            self._send(e.status, e.body(), allow=", ".join(routes.get(path, {})) if e.status == 405 else None)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: normal, said in one line
            self.close_connection = True
            sys.stderr.write(f"{self.address_string()} disconnected before its answer was sent ({method} {path})\n")
        except Exception as e:  # the generator broke: say so, keep serving
            error = RequestError(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error").body()
            try:
                if not self.streaming:
                    self._send(500, error)
                else:  # the stream's headers are out: the error goes as its last event
                    self.wfile.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            except OSError:  # the client went away meanwhile
                self.close_connection = True

    def _completions(self) -> dict | None:
        request = parse_request(self._served_body(), self.server.limits)
        if request.stream:
            return self._stream(request, chat=False)
        return self.server.complete(request)

    def _chat_completions(self) -> dict | None:
        request = parse_chat_request(self._served_body(), self.server.limits)
        if request.stream:
            return self._stream(request, chat=True)
        return chat_response(self.server.complete(request))

    def _stream(self, request: Completion, chat: bool) -> None:
        """Server-sent events, as OpenAI streams: a chunk per piece of text, a last chunk with
        the finish reason, then ``data: [DONE]``. The request is checked before the first byte
        goes out, so a bad one still gets its JSON error."""
        self.server.encode(request)
        ident, created = uuid.uuid4().hex, int(time.time())
        chunks_sent = 0

        def send(text: str, finish: str | None) -> None:
            nonlocal chunks_sent
            if chunks_sent == 0:
                self.streaming = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                self.close_connection = True  # no length: the stream ends when the connection does
            if chat:  # the first delta names the role; the last (the finish reason alone) is empty
                delta = {"content": text} if text or finish is None else {}
                delta = {"role": "assistant", **delta} if chunks_sent == 0 else delta
                chunk = {"id": f"chatcmpl-{ident}", "object": "chat.completion.chunk", "created": created,
                         "model": self.server.model_name,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            else:
                chunk = {"id": f"cmpl-{ident}", "object": "text_completion", "created": created,
                         "model": self.server.model_name,
                         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if finish is not None:
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            chunks_sent += 1

        try:
            self.server.stream(request, send)
        except Cut:  # the server is stopping: the stream ends with its last chunk and an error event
            if chunks_sent == 0:
                raise RequestError(503, STOP_ERROR["error"]["message"], kind="server_shutdown") from None
            send("", "abort")
            self.wfile.write(f"data: {json.dumps(STOP_ERROR)}\n\n".encode())
            self.wfile.flush()
        return None

    def _tokenizer_info(self) -> dict:
        tok = self.server.tokenizer
        eos = None if tok.eod is None else tok.decode([tok.eod])
        return {"tokenizer_class": tok.name, "eos_token": eos, "bos_token": None, "pad_token": None,
                "model_max_length": self.server.limits.max_context}

    def _tokenize(self) -> dict:
        body = self._json_body()
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise RequestError(400, f'send {{"prompt": "text"}} to tokenize, not {json.dumps(body)[:80]}', "prompt")
        tokens = self.server.tokenizer.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.server.limits.max_context}

    def _detokenize(self) -> dict:
        body = self._json_body()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError(400, f'send {{"tokens": [ids]}} to detokenize, not {json.dumps(body)[:80]}', "tokens")
        vocab = self.server.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in tokens):
            raise RequestError(400, f"tokens holds ids outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.server.tokenizer.decode(tokens)}

    def _model_card(self) -> dict:
        """The served model, as OpenAI's ``GET /v1/models`` lists one."""
        return {"id": self.server.model_name, "object": "model", "created": self.server.started, "owned_by": "fxmega"}

    def _unknown_model(self, name: str) -> NoReturn:
        raise RequestError(404, f"the model {name!r} does not exist here: this server serves "
                                f"{self.server.model_name!r} (GET /v1/models lists it)", "model",
                           kind="invalid_request_error", code="model_not_found")

    def _served_body(self) -> Any:
        """The JSON body, refused with 404 when it names a model other than the served one
        (OpenAI's answer), rather than answered by a model it did not ask for."""
        body = self._json_body()
        if isinstance(body, dict) and body.get("model") not in (None, self.server.model_name):
            self._unknown_model(str(body["model"]))
        return body

    def _json_body(self) -> Any:
        length = self._content_length(required=True)
        limit = self.server.limits.max_body_bytes
        if length > limit:
            self._drain(length)
            raise RequestError(413, f"the body is {length} bytes, more than the {limit} this server takes: send a "
                                    f"shorter prompt or fewer prompts per request", kind="request_too_large")
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise RequestError(400, f"the body ended after {len(raw)} of the {length} bytes its Content-Length "
                                    f"announced")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(400, f"the body is not valid JSON ({e}); send a JSON object such as "
                                    f'{{"prompt": "Hello", "max_tokens": 16}}') from None
        except RecursionError:
            raise RequestError(400, "the body nests arrays or objects too deeply to read; a request is a flat JSON "
                                    'object such as {"prompt": "Hello", "max_tokens": 16}') from None
        try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"), which is no text a tokenizer can read
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end].encode("utf-8", "backslashreplace").decode()
            raise RequestError(400, f"the body holds {bad}, a lone UTF-16 surrogate, which is not a character: "
                                    f"send valid Unicode text (a surrogate pair, or the character itself)") from None
        return body

    def _content_length(self, required: bool) -> int:
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            self.close_connection = True
            raise RequestError(411, "chunked bodies are not accepted: send the body with a Content-Length header",
                               kind="length_required")
        value = self.headers.get("Content-Length")
        if value is None:
            if required:
                raise RequestError(411, "a Content-Length header is required: send the JSON body with its length",
                                   kind="length_required")
            return 0
        if not value.strip().isdigit():
            self.close_connection = True
            raise RequestError(400, f"Content-Length {value!r} is not a byte count")
        return int(value)

    def _drain(self, length: int) -> None:
        """Read and drop a body we will not use, so that answering before reading it does not
        reset the connection under the client; a huge one is not read: the connection closes."""
        self.close_connection = True
        if 0 < length <= DRAIN_FACTOR * self.server.limits.max_body_bytes:
            while length > 0:
                chunk = self.rfile.read(min(length, 1 << 16))
                if not chunk:
                    break
                length -= len(chunk)

    def _send(self, status: int, body: dict, allow: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log_requests:
            sys.stderr.write(f"{self.address_string()} - {format % args}\n")


def serve(generate_fn: GenerateFn, tokenizer: Tokenizer, host: str = "127.0.0.1", port: int = 0, *,
          max_prompt_tokens: int = 512, max_new_tokens_limit: int = 256, max_context: int | None = None,
          max_prompts: int = 16, max_body_bytes: int = 1 << 20, model_name: str = "fxmega",
          log_requests: bool = False, block: bool = False, score_fn: ScoreFn | None = None) -> CompletionServer:
    """Serve completions on ``host:port`` (0: any free port; see ``server.url``). Returns the
    running server, serving from a daemon thread; ``server.stop()`` ends it. With ``block``
    it serves in this thread until interrupted (Ctrl-C) and then closes."""
    limits = Limits(max_prompt_tokens, max_new_tokens_limit, max_context, max_prompts, max_body_bytes=max_body_bytes)
    server = CompletionServer(generate_fn, tokenizer, host, port, limits, model_name, log_requests, score_fn)
    if not block:
        return server.start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return server
