"""Bad input gets the right 4xx and OpenAI's error envelope, never a 5xx, and the server keeps serving."""

import asyncio
import json

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, MODEL_NAME, assert_envelope, start_server

from kvserve.server.settings import ServerSettings

MAX_REQUEST_BYTES = 1 << 20
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, ServerSettings(served_model_names=[MODEL_NAME],
                                                  max_request_bytes=MAX_REQUEST_BYTES))
    yield running
    running.stop()


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


# (name, path, body: dict | bytes, status, expected param or None, expected code or None)
CASES = [
    ("malformed json", COMPLETIONS, b'{"model": "x", "prompt":', 400, None, None),
    ("body is an array", COMPLETIONS, b"[1, 2, 3]", 400, None, None),
    ("empty body", COMPLETIONS, b"", 400, None, None),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe\xfa"}', 400, None, None),
    ("lone surrogate", COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', 400, "prompt", None),
    ("unknown field", COMPLETIONS, completion(max_token=5), 400, "max_token", None),
    ("prompt missing", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt", None),
    ("prompt wrong type", COMPLETIONS, completion(prompt=12.5), 400, "prompt", None),
    ("prompt empty token list", COMPLETIONS, completion(prompt=[]), 400, "prompt", None),
    ("token id out of vocabulary", COMPLETIONS, completion(prompt=[5, 10**9]), 400, "prompt", None),
    ("negative token id", COMPLETIONS, completion(prompt=[-1]), 400, "prompt", None),
    ("max_tokens negative", COMPLETIONS, completion(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens huge", COMPLETIONS, completion(max_tokens=10**12), 400, "prompt", "context_length_exceeded"),
    ("max_tokens astronomic", COMPLETIONS, completion(max_tokens=10**40), 400, "prompt", "context_length_exceeded"),
    ("prompt longer than context", COMPLETIONS, completion(prompt=[5] * (MAX_MODEL_LEN + 1)), 400, "prompt",
     "context_length_exceeded"),
    ("temperature negative", COMPLETIONS, completion(temperature=-1), 400, "temperature", None),
    ("temperature a string", COMPLETIONS, completion(temperature="hot"), 400, "temperature", None),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    ("temperature Infinity", COMPLETIONS, b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature", None),
    ("top_p zero", COMPLETIONS, completion(top_p=0), 400, "top_p", None),
    ("top_p above one", COMPLETIONS, completion(top_p=1.5), 400, "top_p", None),
    ("top_k negative", COMPLETIONS, completion(top_k=-5), 400, "top_k", None),
    ("min_p above one", COMPLETIONS, completion(min_p=2), 400, "min_p", None),
    ("presence_penalty out of range", COMPLETIONS, completion(presence_penalty=5), 400, "presence_penalty", None),
    ("repetition_penalty zero", COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty", None),
    ("n zero", COMPLETIONS, completion(n=0), 400, "n", None),
    ("n huge", COMPLETIONS, completion(n=10**6), 400, "n", None),
    ("too many choices", COMPLETIONS, completion(prompt=[[5]] * 100, n=20), 400, "prompt", None),
    ("logprobs too many", COMPLETIONS, completion(logprobs=100), 400, "logprobs", None),
    ("seed beyond int64", COMPLETIONS, completion(seed=2**70), 400, "seed", None),
    ("stop a number", COMPLETIONS, completion(stop=7), 400, "stop", None),
    ("min_tokens above max_tokens", COMPLETIONS, completion(min_tokens=10, max_tokens=2), 400, "min_tokens", None),
    ("integer with 5000 digits", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None,
     None),
    ("nested too deeply", COMPLETIONS, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None, None),
    ("stream_options without stream", COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("logit_bias above 100", COMPLETIONS, completion(logit_bias={"5": 101}), 400, "logit_bias", None),
    ("logit_bias key not a token id", CHAT, chat(logit_bias={"hello": 1}), 400, "logit_bias", None),
    ("logit_bias token out of vocabulary", COMPLETIONS, completion(logit_bias={"100000": 1}), 400, "logit_bias",
     "invalid_request"),  # the engine's check
    ("suffix", COMPLETIONS, completion(suffix="tail"), 400, "suffix", None),
    ("empty cache_salt", COMPLETIONS, completion(cache_salt=""), 400, "cache_salt", None),
    ("unknown model", COMPLETIONS, completion(model="gpt-4o"), 404, "model", "model_not_found"),
    ("messages empty", CHAT, chat(messages=[]), 400, "messages", None),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages", None),
    ("message without role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role", None),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", None),
    ("tool role", CHAT, chat(messages=[{"role": "tool", "content": "42"}]), 400, "messages[0].role", None),
    ("user content missing", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", None),
    ("image content part", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages[0].content[0]", None),
    ("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
    ("max_completion_tokens negative", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    ("chat max_tokens huge", CHAT, chat(max_tokens=10**9), 400, "messages", "context_length_exceeded"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs", None),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", None),
    ("response_format json", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", None),
    ("chat_template from the client", CHAT, chat(chat_template="{{ 7 * 7 }}"), 400, "chat_template", None),
    ("chat_template_kwargs overriding messages", CHAT, chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", None),
    ("unknown chat field", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", None),
    ("chat unknown model", CHAT, chat(model="nope"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=30)
    error = assert_envelope(response, status)
    assert error["param"] == param, error
    assert error["code"] == code, error


def test_there_are_enough_cases():
    assert len(CASES) >= 25


def test_oversized_body_is_413(server):
    huge = json.dumps(completion(prompt="x" * (MAX_REQUEST_BYTES + 10))).encode()
    assert_envelope(httpx.post(server.url + COMPLETIONS, content=huge, timeout=30), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    assert_envelope(httpx.post(server.url + COMPLETIONS, content=chunked(), timeout=30), 413)


def test_unknown_route_and_wrong_method(server):
    error = assert_envelope(httpx.post(server.url + "/v1/nope", json={}), 404)
    assert error["message"] == "Invalid URL (POST /v1/nope)"
    assert_envelope(httpx.get(server.url + COMPLETIONS), 405)


def test_odd_but_valid_input_is_served(server):
    odd = [
        completion(prompt="🦀 ünïcödé ☃ \u200b\t\n"),
        completion(prompt=[[5, 6], [7]], max_tokens=1),
        completion(stop=["", "zz"], temperature=1e-9, top_k=-1, seed=-(2**63)),
        chat(messages=[{"role": "developer", "content": ""}, {"role": "user", "content": "✓"}]),
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "refusal": None,
                                                          "tool_calls": None}]),
        chat(temperature=1e300, top_k=10**30, repetition_penalty=1e300, user="someone", metadata={"a": "b"}),
    ]
    for body in odd:
        path = CHAT if "messages" in body else COMPLETIONS
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 200, (body, response.text)


def test_garbage_storm_then_server_still_serves(server):
    async def storm():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            requests = [client.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
                        for _, path, body, *_ in CASES] * 2
            return await asyncio.gather(*requests)

    responses = asyncio.run(storm())
    assert all(400 <= r.status_code < 500 for r in responses)
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + COMPLETIONS, json=completion(max_tokens=3), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert server.engine.engine.kv_cache.usage == 0.0
