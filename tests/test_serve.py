"""The completion server over real HTTP on 127.0.0.1: completions equal calling the generator
directly, list prompts, stop strings, and a 4xx naming the field for each bad request."""

import dataclasses
import http.client
import json
import re
import urllib.error
import urllib.request
from functools import partial

import pytest

from fxmega.config import load
from fxmega.data.instructions import END, prompt_text
from fxmega.data.tokenizer import ByteTokenizer
from fxmega.inference.generate import LocalDecoder, generate_cached
from fxmega.inference.scoring import token_scores
from fxmega.inference.serve import serve
from fxmega.inference.stops import TextStream
from fxmega.models import gpt
from fxmega.ops.init import init_params
from tests.conftest import ROOT

TIMEOUT = 30  # seconds, for every request
# no proxy from the environment: these requests go to 127.0.0.1 only
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(server, path, body=None, method="POST"):
    """(status, JSON body, headers) of one request; ``body`` is JSON-encoded unless bytes."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with OPENER.open(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read()), e.headers


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(load(ROOT / "configs" / "tiny_gpt.py").model, init_std=0.3)  # varied tokens
    return cfg, init_params(gpt.param_specs(cfg), seed=0)


@pytest.fixture(scope="module")
def server(model):
    cfg, params = model
    srv = serve(partial(generate_cached, gpt.FAMILY, params, cfg), ByteTokenizer(), "127.0.0.1", 0,
                max_prompt_tokens=60,
                max_new_tokens_limit=16, max_context=cfg.max_seq_len, max_body_bytes=4096, model_name="tiny-gpt")
    yield srv
    srv.stop()


def test_health(server):
    assert request(server, "/health", method="GET")[:2] == (200, {"status": "ok", "model": "tiny-gpt"})


def test_greedy_completion_equals_calling_the_generator(server, model):
    cfg, params = model
    tok = ByteTokenizer()
    status, body, headers = request(server, "/v1/completions",
                                    {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "seed": 1})
    assert status == 200 and headers["Content-Type"] == "application/json"
    expected = tok.decode(generate_cached(gpt.FAMILY, params, cfg, [tok.encode("Hello")], 8, seed=1)[0])
    assert body["choices"] == [{"index": 0, "text": expected, "logprobs": None, "finish_reason": "length"}]
    assert body["object"] == "text_completion" and body["model"] == "tiny-gpt" and body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_seeded_sampling_equals_the_generator_and_repeats(server, model):
    cfg, params = model
    tok = ByteTokenizer()
    ask = {"prompt": "Once", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 5}
    first = request(server, "/v1/completions", ask)[1]["choices"][0]["text"]
    direct = generate_cached(gpt.FAMILY, params, cfg, [tok.encode("Once")], 12, temperature=1.0, top_k=20, top_p=0.9,
                             seed=5)[0]
    assert first == tok.decode(direct)
    assert request(server, "/v1/completions", ask)[1]["choices"][0]["text"] == first


def test_a_list_prompt_gets_one_choice_per_prompt(server, model):
    cfg, params = model
    tok = ByteTokenizer()
    prompts = ["a", "bcd", "Hello there"]
    status, body, _ = request(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, body["choices"]):
        assert choice["text"] == tok.decode(generate_cached(gpt.FAMILY, params, cfg, [tok.encode(prompt)], 6)[0])
    assert body["usage"]["prompt_tokens"] == 1 + 3 + 11 and body["usage"]["completion_tokens"] == 18


SCRIPT = b"Hello, world.\nBye!"


def scripted(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, seed):
    """A stand-in generator: always 'writes' SCRIPT, stopping as generate_cached does."""
    if prompts[0] == list(b"boom"):
        raise RuntimeError("the device fell over")
    if prompts[0] == list(b"refuse"):
        raise ValueError("prompt 0 is refused by the generator")
    if bytes(prompts[0]).endswith(b"<|assistant|>\n"):  # a chat: answer in the template, then go on
        return [list(b"Paris.<|end|>\n<|user|>\nmore")[:max_new_tokens] for _ in prompts]
    out = []
    for _ in prompts:
        row = list(SCRIPT[:max_new_tokens])
        ends = [row.index(t) for t in stop_tokens if t in row]
        out.append(row[:min(ends)] if ends else row)
    return out


@pytest.fixture(scope="module")
def scripted_server():
    srv = serve(scripted, ByteTokenizer(), max_new_tokens_limit=64)
    yield srv
    srv.stop()


@pytest.mark.parametrize("stop,text,finish,completion_tokens", [
    (None, "Hello, world.\nBye!", "length", 18),
    ("\n", "Hello, world.", "stop", 14),  # one token: generation itself stops (and counts it)
    (["zzz", "orld"], "Hello, w", "stop", 18),  # several tokens: cut from the text
    (["!", "o"], "Hell", "stop", 5),  # the earliest of several
])
def test_stop_strings_cut_the_text_and_say_stop(scripted_server, stop, text, finish, completion_tokens):
    body = {"prompt": "hi", "max_tokens": 18, **({"stop": stop} if stop else {})}
    status, out, _ = request(scripted_server, "/v1/completions", body)
    assert status == 200
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == (text, finish)
    assert out["usage"]["completion_tokens"] == completion_tokens


def test_generator_failures_are_400_for_its_value_errors_and_500_otherwise(scripted_server):
    status, body, _ = request(scripted_server, "/v1/completions", {"prompt": "refuse"})
    assert status == 400 and "refused by the generator" in body["error"]["message"]
    status, body, _ = request(scripted_server, "/v1/completions", {"prompt": "boom"})
    assert status == 500 and body["error"]["type"] == "server_error" and "fell over" in body["error"]["message"]
    assert request(scripted_server, "/health", method="GET")[0] == 200  # still serving


BAD = [
    # (body, status, param, words the message must hold)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({}, 400, "prompt", "prompt is required"),
    ({"prompt": 5}, 400, "prompt", "prompt must be a string"),
    ({"prompt": []}, 400, "prompt", "empty list"),
    ({"prompt": ["a", 3]}, 400, "prompt", "list of strings"),
    ({"prompt": ""}, 400, "prompt", "encodes to no tokens"),
    ({"prompt": "x" * 61}, 400, "prompt", "61 tokens, more than the 60"),
    ({"prompt": "x" * 55, "max_tokens": 16}, 400, "max_tokens", "lower max_tokens to at most 9"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 must be between 1 and 16"),
    ({"prompt": "hi", "max_tokens": 17}, 400, "max_tokens", "max_tokens=17 must be between 1 and 16"),
    ({"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens", "max_tokens must be an integer"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature", "temperature=-0.5 must be 0"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature must be a finite number"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p=0.0 must be in (0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p=1.5 must be in (0, 1]"),
    ({"prompt": "hi", "top_k": -1}, 400, "top_k", "top_k=-1 must be 0 or more"),
    ({"prompt": "hi", "stop": 3}, 400, "stop", "stop must be"),
    ({"prompt": "hi", "seed": -1}, 400, "seed", "seed=-1"),
    ({"prompt": ["a", "b"], "stream": True}, 400, "stream", "stream=true takes one prompt per request"),
    ({"prompt": "x" * 5000}, 413, None, "more than the 4096"),
]


@pytest.mark.parametrize("body,status,param,words", BAD, ids=[f"{b[2] or b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_a_4xx_naming_the_field(server, body, status, param, words):
    got, out, _ = request(server, "/v1/completions", body)
    assert got == status
    error = out["error"]
    assert error["param"] == param and words in error["message"] and error["type"]
    if param:
        assert param in error["message"]


def test_unknown_paths_and_wrong_methods(server):
    status, out, _ = request(server, "/v1/embeddings", {"input": "hi"})
    assert status == 404 and "/v1/embeddings" in out["error"]["message"]
    assert "POST /v1/chat/completions" in out["error"]["message"]
    status, out, headers = request(server, "/v1/completions", method="GET")
    assert status == 405 and headers["Allow"] == "POST" and "use POST" in out["error"]["message"]
    status, out, headers = request(server, "/health", {"prompt": "hi"})
    assert status == 405 and headers["Allow"] == "GET"
    status, out, _ = request(server, "/v1/completions", b"", method="PUT")
    assert status == 405
    status, out, _ = request(server, "/v1/completions", b"")
    assert status == 400 and "not valid JSON" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=TIMEOUT)
    try:
        conn.putrequest("POST", "/v1/completions")  # no Content-Length header
        conn.endheaders()
        reply = conn.getresponse()
        assert reply.status == 411 and "Content-Length" in json.loads(reply.read())["error"]["message"]
    finally:
        conn.close()


def test_the_served_model_is_listed_and_another_model_is_404(server):
    # OpenAI's clients list models first (client.models.list()): GET /v1/models must answer
    status, out, _ = request(server, "/v1/models", method="GET")
    assert status == 200 and out["object"] == "list" and [m["id"] for m in out["data"]] == ["tiny-gpt"]
    assert request(server, "/v1/models/tiny-gpt", method="GET")[1]["id"] == "tiny-gpt"
    for path, body, method in [("/v1/models/gpt-4", None, "GET"),
                               ("/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 2}, "POST"),
                               ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT, "max_tokens": 2}, "POST")]:
        status, out, _ = request(server, path, body, method=method)
        assert status == 404 and out["error"]["code"] == "model_not_found", (path, out)
        assert "'gpt-4'" in out["error"]["message"] and "'tiny-gpt'" in out["error"]["message"]
    assert request(server, "/v1/completions", {"model": "tiny-gpt", "prompt": "hi", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("raw,words", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "lone UTF-16 surrogate"),
    (b'{"prompt": ["\\udfff"], "max_tokens": 2}', "lone UTF-16 surrogate"),
    (b"[" * 2000 + b"]" * 2000, "too deeply"),  # within the 4096-byte limit, past Python's recursion limit
])
def test_bodies_no_tokenizer_can_read_are_400(server, raw, words):
    status, out, _ = request(server, "/v1/completions", raw)
    assert status == 400 and words in out["error"]["message"], out


CHAT = [{"role": "system", "content": "Be."}, {"role": "user", "content": "Hi?"}]  # 56 tokens rendered


def test_chat_completion_answers_in_the_assistants_turn(server, model):
    """The conversation rendered with the chat template, completed, cut at the template's end
    of message: the same text as /v1/completions of the rendered prompt with that stop."""
    status, body, _ = request(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    plain = request(server, "/v1/completions", {"prompt": prompt_text(CHAT), "max_tokens": 8, "temperature": 0,
                                                "stop": [END]})[1]
    choice = plain["choices"][0]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": choice["text"]},
                                "logprobs": None, "finish_reason": choice["finish_reason"]}]
    assert body["usage"] == plain["usage"] and body["usage"]["prompt_tokens"] == len(prompt_text(CHAT).encode())


def test_chat_answer_stops_at_the_end_of_message(scripted_server):
    ask = {"messages": CHAT, "max_completion_tokens": 30}
    status, body, _ = request(scripted_server, "/v1/chat/completions", ask)
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert body["choices"][0]["finish_reason"] == "stop"


CHAT_BAD = [
    ({}, "messages", "messages must be a non-empty list"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "messages[0] must be"),
    ({"messages": [{"role": "user"}]}, "messages", "messages[0] must be"),
    ({"prompt": "hi"}, "prompt", "a chat request sends messages"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "tools=[{"),
    ({"messages": CHAT, "max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens", "give one of them"),
    ({"messages": CHAT, "max_completion_tokens": 17}, "max_tokens", "must be between 1 and 16"),
    ({"messages": [{"role": "user", "content": "x" * 40}]}, "messages", "messages (with the chat template) is"),
]


@pytest.mark.parametrize("body,param,words", CHAT_BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(CHAT_BAD)])
def test_bad_chat_requests_get_a_400_naming_the_field(server, body, param, words):
    got, out, _ = request(server, "/v1/chat/completions", body)
    assert got == 400 and out["error"]["param"] == param and words in out["error"]["message"]


def test_a_stopped_server_refuses_connections():
    srv = serve(scripted, ByteTokenizer())
    assert request(srv, "/health", method="GET")[0] == 200
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        request(srv, "/health", method="GET")


@pytest.fixture(scope="module")
def scoring_server(model):
    cfg, params = model
    srv = serve(partial(generate_cached, gpt.FAMILY, params, cfg), ByteTokenizer(), "127.0.0.1", 0,
                max_prompt_tokens=60,
                max_new_tokens_limit=16, max_context=cfg.max_seq_len, model_name="tiny-gpt",
                score_fn=partial(token_scores, LocalDecoder(gpt.FAMILY, params, cfg), cfg))
    yield srv
    srv.stop()


def test_echo_with_logprobs_scores_the_prompt_and_the_completion(scoring_server, model):
    """What lm-eval's local-completions sends to score a continuation: token ids, echo,
    logprobs=1, max_tokens=1. The prompt comes back before the completion; every token but the
    first has the model's log-probability given those before it, and its most likely
    alternative, which is the greedy completion's own token."""
    cfg, params = model
    ids = ByteTokenizer().encode("the quick brown")
    status, body, _ = request(scoring_server, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "echo": True,
                                                                  "logprobs": 1, "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    new = generate_cached(gpt.FAMILY, params, cfg, [ids], 1)[0]
    assert choice["text"] == "the quick brown" + ByteTokenizer().decode(new)
    lp = choice["logprobs"]
    assert lp["tokens"] == [chr(t) for t in ids + new] and lp["text_offset"] == list(range(len(ids) + 1))
    want = token_scores(LocalDecoder(gpt.FAMILY, params, cfg), cfg, [ids + new], top=1)[0]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want.logprobs, rel=1e-6)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1])  # greedy


def test_logprobs_without_echo_cover_the_completion(scoring_server, model):
    cfg, params = model
    status, body, _ = request(scoring_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                                                  "logprobs": 3, "temperature": 0})
    assert status == 200, body
    ids = ByteTokenizer().encode("Hello")
    new = generate_cached(gpt.FAMILY, params, cfg, [ids], 4)[0]
    lp = body["choices"][0]["logprobs"]
    want = token_scores(LocalDecoder(gpt.FAMILY, params, cfg), cfg, [ids + new], top=3)[0]
    assert lp["token_logprobs"] == pytest.approx(want.logprobs[len(ids) - 1:], rel=1e-6)
    assert lp["text_offset"][0] == len("Hello") and all(1 <= len(top) <= 3 for top in lp["top_logprobs"])


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(scoring_server):
    status, body, _ = request(scoring_server, "/v1/completions", {"prompt": "abc", "max_tokens": 0, "echo": True,
                                                                  "logprobs": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == "abc" and body["usage"]["completion_tokens"] == 0
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 3


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "hi", "logprobs": 6}, "logprobs", "logprobs=6 must be between 0 and 5"),
    ({"prompt": "hi", "echo": "yes"}, "echo", "echo must be true or false"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens=0 must be between 1 and 16"),
    ({"prompt": [[1, 2], [3, 999]]}, "prompt", r"prompt\[1\] holds token ids outside the tokenizer's vocabulary"),
    ({"prompt": [1, True]}, "prompt", "prompt must be a string, a non-empty list of strings, a list of token ids"),
])
def test_bad_scoring_requests_are_refused(scoring_server, body, param, message):
    status, got, _ = request(scoring_server, "/v1/completions", body)
    assert status == 400 and got["error"]["param"] == param
    assert re.search(message, got["error"]["message"]), got


def test_logprobs_are_refused_by_a_server_without_a_scorer(server):
    status, got, _ = request(server, "/v1/completions", {"prompt": "hi", "logprobs": 1})
    assert status == 400 and "not scored token by token" in got["error"]["message"]


def test_the_tokenizer_endpoints(scoring_server):
    assert request(scoring_server, "/tokenize", {"prompt": "hé", "add_special_tokens": False})[1] == \
        {"tokens": [104, 195, 169], "count": 3, "max_model_len": 64}
    assert request(scoring_server, "/detokenize", {"tokens": [104, 195, 169]})[1] == {"prompt": "hé"}
    info = request(scoring_server, "/tokenizer_info", method="GET")[1]
    assert info["eos_token"] is None and info["model_max_length"] == 64  # bytes: no end-of-text token
    assert request(scoring_server, "/detokenize", {"tokens": [300]})[0] == 400


def test_a_character_split_over_tokens_and_a_stop_string_in_the_making_are_held_back():
    stream = TextStream(ByteTokenizer(), ["END"], [])
    assert [stream.add(t) for t in "aé".encode()] == ["a", "", "é"]  # é is two bytes
    assert [stream.add(t) for t in b"xEN"] == ["x", "", ""]  # "EN" may become "END"
    assert stream.add(ord("D")) == "" and stream.stopped and stream.add(ord("z")) == ""
    stream = TextStream(ByteTokenizer(), ["END"], [0])
    assert [stream.add(t) for t in b"EN"] == ["", ""] and stream.add(0) == "EN" and stream.stopped


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def test_the_openai_client_streams_completions_as_the_whole_answer(client):
    whole = client.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=12, temperature=0, seed=1)
    chunks = list(client.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=12, temperature=0, seed=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == "length"
    stop = whole.choices[0].text[4:6]  # a stop string the stream must not show any of
    cut = list(client.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=12, temperature=0, seed=1,
                                         stream=True, stop=[stop]))
    text = whole.choices[0].text
    assert "".join(c.choices[0].text for c in cut) == text[:text.index(stop)]
    assert cut[-1].choices[0].finish_reason == "stop"


def test_the_openai_client_streams_chat(client):
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=10, temperature=0, seed=2)
    chunks = list(client.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=10, temperature=0,
                                                 seed=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
