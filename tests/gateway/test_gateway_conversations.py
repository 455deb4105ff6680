"""Conversations through the gateway: the history is stored (Redis, or SQLite without it) and sent back exactly,
so the backend's prefix cache hits more every turn; streams pass through and a client that leaves aborts the
request on the backend."""

from __future__ import annotations

import httpx
import pytest

from gateway_harness import (
    MODEL_NAME, backends_fixture, conversation_turn, gateway_settings, metric, needs_redis, redis_fixture,
    start_gateway, stored_messages,
)
from server_harness import slowed, wait_until

pytestmark = needs_redis

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer about paged KV caches and blocks."}
QUESTIONS = ["What is a block?", "And a block table?", "Why hash blocks?", "What is evicted first?"]

backends = backends_fixture(2)
redis = redis_fixture(scope="module")


def prefix_hits(backend) -> float:
    return backend.metrics()["vllm:prefix_cache_hits_total"]


@pytest.mark.parametrize("store", ["redis", "sqlite"])
def test_conversation_history_is_resent_exactly_and_the_prefix_cache_hits_more_each_turn(
        backends, redis, tmp_path, store):
    urls = [b.url for b in backends]
    settings = (gateway_settings(urls, redis_url=redis.url) if store == "redis"
                else gateway_settings(urls, state_path=str(tmp_path / "gw.sqlite3")))
    gateway = start_gateway(settings)
    conversation_id = f"chat-{store}"
    try:
        expected: list[dict] = []
        cached_tokens, hit_gains, served_by = [], [], set()
        for turn, question in enumerate(QUESTIONS):
            # The system prompt names the store: turn 1 must find nothing another test left in a backend's cache.
            system = {**SYSTEM, "content": f"[{store}] {SYSTEM['content']}"}
            new = ([system] if turn == 0 else []) + [{"role": "user", "content": question}]
            before = {b.url: prefix_hits(b) for b in backends}
            completion, headers = conversation_turn(gateway, conversation_id, new)
            served_by.add(headers["x-kvserve-backend"])
            after = {b.url: prefix_hits(b) for b in backends}
            hit_gains.append(after[headers["x-kvserve-backend"]] - before[headers["x-kvserve-backend"]])
            cached_tokens.append(completion.usage.prompt_tokens_details.cached_tokens)
            expected += [*new, {"role": "assistant", "content": completion.choices[0].message.content}]
            assert stored_messages(gateway, conversation_id) == expected  # every turn, exactly as sent and answered
        assert len(served_by) == 1  # the conversation is its own session
        assert hit_gains[0] == 0 and all(gain > 0 for gain in hit_gains[1:])
        assert cached_tokens[1:] == sorted(cached_tokens[1:]) and cached_tokens[-1] > cached_tokens[1] > 0
    finally:
        gateway.stop()


@pytest.mark.parametrize("store", ["redis", "sqlite"])
def test_a_retried_turn_is_stored_once(backends, redis, tmp_path, store):
    urls = [b.url for b in backends]
    settings = (gateway_settings(urls, redis_url=redis.url) if store == "redis"
                else gateway_settings(urls, state_path=str(tmp_path / "gw.sqlite3")))
    gateway = start_gateway(settings)
    conversation_id = f"retried-{store}"
    question = [{"role": "user", "content": "What is a block?"}]
    try:
        for _ in range(2):  # the client did not see the first answer and sends the request again
            conversation_turn(gateway, conversation_id, question, extra_headers={"Idempotency-Key": "turn-1"})
        assert [m["role"] for m in stored_messages(gateway, conversation_id)] == ["user", "assistant"]
        conversation_turn(gateway, conversation_id, question, extra_headers={"Idempotency-Key": "turn-2"})
        conversation_turn(gateway, conversation_id, question)  # no key: every request is a turn of its own
        assert len(stored_messages(gateway, conversation_id)) == 6
    finally:
        gateway.stop()


def test_streamed_turn_is_passed_through_and_stored_as_streamed(backends, redis, monkeypatch):
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    # Tokens a consumer has not picked up yet are merged into one chunk (async_engine.RequestStream); on a busy
    # machine the tiny model's 8 tokens could all be ready before the first chunk reached the client.
    for backend in backends:
        monkeypatch.setattr(backend.engine.engine, "step", slowed(backend.engine.engine.step, 0.05))
    try:
        client = gateway.openai()
        deltas, token_chunks = [], 0
        # logprobs: a chunk for every token, even one whose bytes do not finish a character yet (the random
        # model's text may hold back all its bytes until the last token)
        for chunk in client.chat.completions.create(
                model=MODEL_NAME, messages=[SYSTEM, {"role": "user", "content": QUESTIONS[0]}], max_tokens=8,
                temperature=0, stream=True, logprobs=True, extra_body={"conversation": "streamed"}):
            deltas.extend(choice.delta.content or "" for choice in chunk.choices)
            token_chunks += sum(1 for choice in chunk.choices if choice.logprobs and choice.logprobs.content)
        assert token_chunks > 1  # many chunks, not one buffered blob
        assert stored_messages(gateway, "streamed")[-1] == {"role": "assistant", "content": "".join(deltas)}
        completion, _ = conversation_turn(gateway, "streamed", [{"role": "user", "content": QUESTIONS[1]}])
        assert completion.usage.prompt_tokens_details.cached_tokens > 0
        assert len(stored_messages(gateway, "streamed")) == 5
    finally:
        gateway.stop()


def test_client_disconnect_aborts_the_backend_request(backends, redis, monkeypatch):
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    for backend in backends:
        monkeypatch.setattr(backend.engine.engine, "step", slowed(backend.engine.engine.step, 0.05))
    aborted = {b.url: b.metrics()["vllm:request_success_total{finished_reason=abort}"] for b in backends}
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{gateway.base_url}/completions", json=body) as response:
                assert response.status_code == 200
                backend = next(b for b in backends if b.url == response.headers["x-kvserve-backend"])
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
        # Leaving the block drops the client's connection mid-stream; the gateway must drop its own upstream.
        assert wait_until(lambda: backend.metrics()["vllm:request_success_total{finished_reason=abort}"]
                          == aborted[backend.url] + 1, timeout_s=10)
        assert wait_until(lambda: backend.metrics()["vllm:num_requests_running"] == 0, timeout_s=10)
        samples = gateway.metrics()
        assert metric(samples, "kvserve:gateway_requests_total", backend=backend.url,
                      outcome="client_disconnected") == 1
    finally:
        gateway.stop()


def test_conversation_on_completions_is_refused_in_the_envelope(backends, redis):
    from server_harness import assert_envelope

    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    try:
        response = httpx.post(f"{gateway.base_url}/completions", timeout=10,
                              json={"model": MODEL_NAME, "prompt": "hi", "conversation": "c"})
        assert assert_envelope(response, 400)["param"] == "conversation"
        response = httpx.get(f"{gateway.base_url}/conversations/never-started", timeout=10)
        assert assert_envelope(response, 404)["code"] == "conversation_not_found"
    finally:
        gateway.stop()
