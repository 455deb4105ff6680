"""Tokens/min that hold (a real redis-server, real backends): a burst from one key is served at most its limit,
the rest 429, because each request reserves its prompt and max_tokens as it is admitted; the reservation is
settled to the usage afterwards, and a stream the client leaves is charged what was sent, not nothing."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway_harness import (
    MODEL_NAME, backends_fixture, gateway_settings, needs_redis, redis_fixture, start_gateway, start_of_a_window,
)
from server_harness import assert_envelope, slowed, wait_until

from kvserve.gateway.keys import create_key
from kvserve.gateway.limits import WINDOW_S
from kvserve.gateway.store import PREFIX, RedisStore, StoreLimits

pytestmark = needs_redis

backends = backends_fixture(2)
redis = redis_fixture()


@pytest.fixture()
def gateway(backends, redis):
    running = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url, require_api_key=True))
    yield running
    running.stop()


def new_key(redis, tokens_per_minute: int) -> tuple[str, str]:
    """(key, key id), stored in the gateway's Redis."""
    async def create():
        store = RedisStore(redis.url, StoreLimits())
        try:
            key, record = await create_key(store, "tenant", tokens_per_minute=tokens_per_minute)
        finally:
            await store.close()
        return key, record.key_id

    return asyncio.run(create())


def tokens_counted(redis, key_id: str, window: int) -> int:
    return int(redis.cli("GET", f"{PREFIX}counter:{key_id}:tokens:{window}").strip() or 0)


def request_tokens(gateway, key: str, index: int) -> tuple[int, int]:
    """(status, tokens served) of one request of the burst: odd ones streamed (usage asked), even ones whole."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"request {index}: tell me of blocks"}],
            "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    if index % 2 == 0:
        response = httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers=headers, timeout=60)
        served = response.json()["usage"]["total_tokens"] if response.status_code == 200 else 0
        return response.status_code, served
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, headers=headers,
                      timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, 0
        usage = [json.loads(line[6:])["usage"] for line in response.iter_lines()
                 if line.startswith("data: {") and '"usage":{' in line.replace(" ", "")]
        return 200, usage[-1]["total_tokens"]


def test_a_burst_is_served_at_most_the_tokens_per_minute_and_the_rest_get_429(gateway, redis):
    limit = 400
    key, key_id = new_key(redis, limit)
    assert_burst_held(redis, key_id, limit, lambda index: request_tokens(gateway, key, index))


def assert_burst_held(redis, key_id: str, limit: int, send) -> None:
    """16 requests at once, `send(index)` -> (status, tokens served): some served, the rest 429, at most `limit`
    tokens served in the window, and the window's counter settled to exactly what was served."""
    window = start_of_a_window()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, range(16)))
    assert int(time.time() // WINDOW_S) == window
    statuses = [status for status, _ in results]
    served = sum(tokens for _, tokens in results)
    assert set(statuses) == {200, 429}, statuses
    assert 0 < served <= limit, (served, statuses)
    assert wait_until(lambda: tokens_counted(redis, key_id, window) == served, timeout_s=10)  # settled to usage


def test_a_request_no_window_could_take_is_refused_as_too_large(gateway, redis):
    key, _ = new_key(redis, 100)
    start_of_a_window()
    response = httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": MODEL_NAME, "max_tokens": 500,
                                            "messages": [{"role": "user", "content": "hi"}]})
    error = assert_envelope(response, 429)
    assert error["type"] == "tokens" and "too large" in error["message"]


def test_a_stream_cut_short_is_charged_what_was_sent(gateway, backends, redis, monkeypatch):
    for backend in backends:
        monkeypatch.setattr(backend.engine.engine, "step", slowed(backend.engine.engine.step, 0.05))
    key, key_id = new_key(redis, 10_000)
    window = start_of_a_window()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{gateway.base_url}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]  # a few chunks, then the client leaves
    assert any(line.startswith("data: ") for line in received)
    reserved = 16 + 8 + len("user") + len("a long answer please") + 200

    def settled() -> bool:
        return tokens_counted(redis, key_id, window) < reserved

    assert wait_until(settled, timeout_s=15)
    charged = tokens_counted(redis, key_id, window)
    assert charged > 16 + 8 + len("a long answer please")  # its prompt and what it was sent: not nothing


def store_histories(redis, key_id: str, conversation_ids: list[str], history: list[dict]) -> None:
    from kvserve.gateway.conversation import stored_id

    async def store_all():
        store = RedisStore(redis.url, StoreLimits())
        try:
            for conversation_id in conversation_ids:
                await store.conversation_append(stored_id(conversation_id, key_id), history)
        finally:
            await store.close()

    asyncio.run(store_all())


def test_a_burst_of_conversation_turns_is_held_to_the_limit_with_their_histories(gateway, redis):
    """A turn sends only its new message; the stored history the gateway puts before it is a prompt too, known
    only after admission. It must count against the limit before the turn is sent, or a burst of short turns on
    long conversations is all admitted and served many times the limit."""
    # Each turn is admitted on its own estimate (38 tokens) before its history (~240) is reserved: even when all 16
    # admissions land before the first history does (608 tokens), that one must still fit, so one turn is served
    # whatever the threads' order, and the 16 histories (~4,400 tokens) cannot.
    limit = 1000
    key, key_id = new_key(redis, limit)
    conversations = [f"long-{index}" for index in range(16)]
    said = "Tell me about the paged block pool and how prefix caching shares blocks between requests. " * 2
    store_histories(redis, key_id, conversations, [{"role": "user", "content": said},
                                                   {"role": "assistant", "content": "Blocks are shared."}])

    def turn(index: int) -> tuple[int, int]:
        response = httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              timeout=60, json={"model": MODEL_NAME, "max_tokens": 4, "ignore_eos": True,
                                                "messages": [{"role": "user", "content": "Go on."}],
                                                "conversation": conversations[index]})
        return response.status_code, response.json()["usage"]["total_tokens"] if response.status_code == 200 else 0

    assert_burst_held(redis, key_id, limit, turn)
