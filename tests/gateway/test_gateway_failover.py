"""A backend killed in the middle of a run: no turn of history is lost, requests that had not started streaming
succeed on another backend, the dead backend's sessions continue there (and stay there), its breaker opens; a
stream already under way is not retried."""

from __future__ import annotations

import httpx

from gateway_harness import (
    MODEL_NAME, backends_fixture, conversation_turn, gateway_settings, kill_backend, metric, needs_redis,
    redis_fixture, start_gateway, stored_messages,
)
from server_harness import slowed

pytestmark = needs_redis

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer about paged KV caches and blocks."}

backends = backends_fixture(3, scope="function")  # the tests kill them
redis = redis_fixture()


def test_killed_backend_loses_no_history_and_its_sessions_continue_elsewhere(backends, redis):
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url, breaker_failures=2,
                                             health_interval_s=60.0))  # no health check helps: retries must
    conversations = [f"conv-{i}" for i in range(8)]
    try:
        placed = {}
        for conversation in conversations:
            for turn in range(2):
                new = ([SYSTEM] if turn == 0 else []) + [{"role": "user", "content": f"question {turn}"}]
                _, headers = conversation_turn(gateway, conversation, new)
                placed[conversation] = headers["x-kvserve-backend"]
        victim_url = max(set(placed.values()), key=list(placed.values()).count)
        orphans = [c for c in conversations if placed[c] == victim_url]
        kill_backend(next(b for b in backends if b.url == victim_url))

        moved_to = {}
        for conversation in conversations:  # turn 3, every one answered, the victim's on another backend
            _, headers = conversation_turn(gateway, conversation, [{"role": "user", "content": "question 2"}])
            moved_to[conversation] = headers["x-kvserve-backend"]
            if conversation in orphans:
                assert moved_to[conversation] != victim_url and headers["x-kvserve-route"] == "failover"
            else:
                assert (moved_to[conversation], headers["x-kvserve-route"]) == (placed[conversation], "session")
        for conversation in conversations:  # turn 4: moved sessions stay moved, and hit their new cache
            completion, headers = conversation_turn(gateway, conversation, [{"role": "user", "content": "question 3"}])
            assert (headers["x-kvserve-backend"], headers["x-kvserve-route"]) == (moved_to[conversation], "session")
            assert completion.usage.prompt_tokens_details.cached_tokens > 0
            messages = stored_messages(gateway, conversation)
            assert [m["content"] for m in messages if m["role"] == "user"] == [f"question {t}" for t in range(4)]
            assert len(messages) == 1 + 4 * 2  # the system prompt, four questions, four answers: nothing lost
        samples = gateway.metrics()
        assert metric(samples, "kvserve:gateway_retries_total", backend=victim_url) == 2  # then the breaker opened
        assert metric(samples, "kvserve:gateway_breaker_state", backend=victim_url) == 2
        assert metric(samples, "kvserve:gateway_routing_decisions_total", reason="failover") == len(orphans)
    finally:
        gateway.stop()


def test_stream_already_under_way_is_not_retried(backends, redis, monkeypatch):
    for backend in backends:
        monkeypatch.setattr(backend.engine.engine, "step", slowed(backend.engine.engine.step, 0.05))
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{gateway.base_url}/completions", json=body, timeout=30) as response:
            victim = next(b for b in backends if b.url == response.headers["x-kvserve-backend"])
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            kill_backend(victim)
            rest = "\n".join(lines)
        assert "data: [DONE]" not in rest and "backend_error" in rest  # the stream says it broke...
        samples = gateway.metrics()
        assert metric(samples, "kvserve:gateway_retries_total", backend=victim.url) == 0  # ...and was not resent
        assert metric(samples, "kvserve:gateway_requests_total", backend=victim.url, outcome="backend_error") == 1
    finally:
        gateway.stop()


def test_every_backend_down_is_a_prompt_503_in_the_envelope(backends, redis):
    from server_harness import assert_envelope

    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    try:
        for backend in backends:
            kill_backend(backend)
        response = httpx.post(f"{gateway.base_url}/chat/completions", timeout=30,
                              json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        error = assert_envelope(response, 503)
        assert error["code"] == "no_backend_available" and response.headers["retry-after"] == "1"
    finally:
        gateway.stop()
