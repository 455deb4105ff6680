"""The prefix index corrected from what real backends report: a prefix-routed request that the backend's usage
shows did not hit (the backend evicted it) expires that backend's entries up to it, so prompts it was sent
before go by load again; a backend that evicts a whole pool's worth of blocks, as its /metrics counts them,
has its older entries expired by the health checks."""

from __future__ import annotations

import time

import httpx

from gateway_harness import (
    MODEL_NAME, backends_fixture, gateway_settings, metric, needs_redis, redis_fixture, start_gateway, wait_for,
)

from kvserve.gateway.store import PREFIX

pytestmark = needs_redis

POOL_BLOCKS = 48  # 768 tokens: a few prompts of the tiny model fill it
backends = backends_fixture(1, num_gpu_blocks_override=POOL_BLOCKS)
redis = redis_fixture()

# Questions longer than a block of the index (32 characters here): each prompt's chain ends in blocks of its own,
# so each is recorded (an identical prompt again within a minute is not written again, see RecentWrites).
ALPHA = "You are alpha, a careful assistant for questions about paged attention. "
BRAVO = "You are bravo, a terse assistant for questions about block hashing only. "


def ask(url: str, system: str, question: str) -> tuple[str, dict]:
    """(route, usage) of a chat completion without a session."""
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response.headers.get("x-kvserve-route", "direct"), response.json()["usage"]


def evict_everything(backend, num_prompts: int, first: int = 0) -> None:
    """Distinct prompts sent to the backend itself, past the gateway: LRU pushes out what it cached before."""
    for index in range(first, first + num_prompts):
        ask(backend.url, f"filler {index} " + "x y z " * 25, f"question {index}")


def index_gateway(backend, redis, health_interval_s: float):
    return start_gateway(gateway_settings([backend.url], redis_url=redis.url, prefix_block_chars=32,
                                          health_interval_s=health_interval_s))


def expiries(gateway, backend, reason: str) -> float:
    return metric(gateway.metrics(), "kvserve:gateway_prefix_index_expiries_total", backend=backend.url,
                  reason=reason)


def test_a_prefix_that_missed_expires_the_entries_recorded_up_to_it(backends, redis):
    backend = backends[0]
    # Health checks far apart: this test is about the requests' own reports, not the eviction counters.
    gateway = index_gateway(backend, redis, health_interval_s=3600)
    try:
        assert ask(gateway.url, ALPHA, "what is a block, and how many tokens does one hold?")[0] == "load"
        assert ask(gateway.url, BRAVO, "what is a block hash, and what does it chain to?")[0] == "load"
        route, usage = ask(gateway.url, ALPHA, "what is a block table, and who owns one of them?")
        assert route == "prefix" and usage["prompt_tokens_details"]["cached_tokens"] > 0  # a true promise
        assert expiries(gateway, backend, "missed") == 0
        evict_everything(backend, 6)
        # The index still promises alpha's blocks, which were evicted:
        route, usage = ask(gateway.url, ALPHA, "what is a slot mapping, and when is it computed?")
        assert route == "prefix" and usage["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for(lambda: redis.cli("HGET", f"{PREFIX}horizons", backend.url).strip() != "")
        assert expiries(gateway, backend, "missed") == 1
        # Bravo was sent before alpha's last turn there: gone too (LRU), so it goes by load, not by a stale entry.
        assert ask(gateway.url, BRAVO, "what is a hash chain, and where does it start?")[0] == "load"
        # Alpha was computed again by the request that missed: its entries are back, and true.
        route, usage = ask(gateway.url, ALPHA, "what is a page, and is it the same as a block?")
        assert route == "prefix" and usage["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        gateway.stop()


def test_a_pool_evicted_whole_expires_the_older_entries_from_the_backends_metrics(backends, redis):
    backend = backends[0]
    gateway = index_gateway(backend, redis, health_interval_s=0.2)
    try:
        assert ask(gateway.url, ALPHA, "what is a block, and how many tokens does one hold?")[0] == "load"
        assert ask(gateway.url, ALPHA, "what is a block table, and who owns one of them?")[0] == "prefix"
        # Wait for a health check after alpha's requests (the one the eviction marks count from): one more
        # request to the backend itself moves its hit rate, and the gateway reads the same rate after it.
        alpha_recorded_by = time.time()
        ask(backend.url, "a probe, nothing cached", "moves the backend's hit rate")
        samples = backend.metrics()
        rate = samples["vllm:prefix_cache_hits_total"] / samples["vllm:prefix_cache_queries_total"]
        wait_for(lambda: metric(gateway.metrics(), "kvserve:gateway_backend_prefix_cache_hit_rate",
                                backend=backend.url) == rate)
        evict_before, first = backend.metrics()["kvserve:prefix_cache_evictions_total"], 1000
        while backend.metrics()["kvserve:prefix_cache_evictions_total"] - evict_before < POOL_BLOCKS:
            evict_everything(backend, 4, first)
            first += 4
        # The checks may first find a pool evicted since an older mark (alpha's own requests evicted the last
        # test's blocks); one of them finds it since the mark after alpha, and the horizon moves past alpha.
        wait_for(lambda: float(redis.cli("HGET", f"{PREFIX}horizons", backend.url).strip() or 0) > alpha_recorded_by)
        assert expiries(gateway, backend, "evictions") >= 1
        # Not promised a prefix it no longer has:
        assert ask(gateway.url, ALPHA, "what is a slot mapping, and when is it computed?")[0] == "load"
    finally:
        gateway.stop()
