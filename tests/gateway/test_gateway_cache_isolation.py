"""One key cannot probe another's prompts (a real redis-server, real backends): by default each key's requests
hit only its own prefix cache (the gateway sets a cache_salt derived from the key, combining any the client
sent) and only its own prefix routes; `--cache-sharing global` shares both."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from gateway_harness import MODEL_NAME, backends_fixture, gateway_settings, needs_redis, redis_fixture, start_gateway
from server_harness import wait_until

from kvserve.gateway.keys import create_key
from kvserve.gateway.store import PREFIX, RedisStore, StoreLimits

pytestmark = needs_redis

backends = backends_fixture(2)
redis = redis_fixture()


def new_keys(redis, count: int) -> list[str]:
    async def create():
        store = RedisStore(redis.url, StoreLimits())
        try:
            return [(await create_key(store, f"tenant-{index}"))[0] for index in range(count)]
        finally:
            await store.close()

    return asyncio.run(create())


def secret_prompt() -> list[dict]:
    """A system prompt of several blocks (the backend's 16 tokens, the gateway's 32 characters), new to every
    backend, well within the tiny model's 256 tokens."""
    system = f"[{uuid.uuid4()}] The secret plans of the company. " * 2
    return [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]


def ask(gateway, key: str, messages: list[dict], **extra) -> tuple[int, str]:
    """(cached_tokens, the route's reason)."""
    response = httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"], response.headers["x-kvserve-route"]


def prefix_entries(redis) -> int:
    return len(redis.cli("KEYS", f"{PREFIX}prefix:*").split())


def start(backends, redis, **overrides):
    return start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url, require_api_key=True,
                                          prefix_block_chars=32, **overrides))


def test_a_key_reading_another_keys_prompt_gets_no_cached_tokens(backends, redis):
    # One backend: the other key's request lands where the owner's blocks are, so only isolation can make it miss.
    gateway = start(backends[:1], redis)
    owner, other = new_keys(redis, 2)
    try:
        prompt = secret_prompt()
        ask(gateway, owner, prompt)
        assert wait_until(lambda: prefix_entries(redis) > 0)  # the owner's prefix route is recorded
        cached, route = ask(gateway, other, prompt)
        assert cached == 0 and route != "prefix"  # neither the cache nor the route says the prompt was seen
        assert ask(gateway, owner, prompt)[0] > 0  # while the owner's repeat hits
    finally:
        gateway.stop()


def test_a_clients_own_salt_is_combined_with_its_keys_never_instead(backends, redis):
    gateway = start(backends, redis)
    owner, other = new_keys(redis, 2)
    try:
        prompt = secret_prompt()
        ask(gateway, owner, prompt, cache_salt="team-a")
        assert ask(gateway, other, prompt, cache_salt="team-a")[0] == 0  # the same salt, another key: no hit
        assert ask(gateway, owner, prompt, cache_salt="team-b")[0] == 0  # the client split its own cache
        assert ask(gateway, owner, prompt, cache_salt="team-a")[0] > 0
    finally:
        gateway.stop()


@pytest.mark.parametrize("sharing", ["global"])
def test_global_cache_sharing_lets_keys_share(backends, redis, sharing):
    gateway = start(backends, redis, cache_sharing=sharing)
    owner, other = new_keys(redis, 2)
    try:
        prompt = secret_prompt()
        ask(gateway, owner, prompt)
        assert wait_until(lambda: prefix_entries(redis) > 0)
        cached, route = ask(gateway, other, prompt)
        assert cached > 0 and route == "prefix"
    finally:
        gateway.stop()
