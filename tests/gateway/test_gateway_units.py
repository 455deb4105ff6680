"""The gateway's pure parts: the ring and its bound, prompt-block hashes, the breaker, SSE event splitting and
reading, key hashing and the rate-limit windows over the SQLite store, and a request's state read alike from
either store."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time

import pytest

from kvserve.gateway.backends import BadBackendURL, normalize_backend_url
from kvserve.gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvserve.gateway.hashring import HashRing, bounded_owner, share_capacity
from kvserve.gateway.keys import create_key, hash_key, key_id_of, verify_key
from kvserve.gateway.limits import admit
from kvserve.gateway.token_budget import TokenCost
from kvserve.gateway.prefix import longest_match, prefix_block_hashes
from kvserve.gateway.request_state import StateQuery
from kvserve.gateway.sqlite_store import SQLiteStore
from kvserve.gateway.store import StoreLimits
from kvserve.gateway.stream import StreamTap, sse_events

NODES = [f"http://10.0.0.{i}:8000" for i in range(4)]


def test_ring_owner_is_stable_and_losing_a_node_moves_only_its_keys():
    ring, smaller = HashRing(NODES), HashRing(NODES[:3])
    keys = [f"session-{i}" for i in range(2000)]
    owners = {key: ring.owner(key) for key in keys}
    assert owners == {key: HashRing(list(reversed(NODES))).owner(key) for key in keys}  # order does not matter
    assert all(smaller.owner(k) == owner for k, owner in owners.items() if owner != NODES[3])
    counts = [list(owners.values()).count(node) for node in NODES]
    assert min(counts) > 2000 / 4 * 0.6  # 64 virtual nodes each: no node owns a sliver


def test_bounded_placement_keeps_every_backend_within_its_share():
    ring, counts = HashRing(NODES), dict.fromkeys(NODES, 0)
    for index in range(1000):
        capacity = share_capacity(counts, NODES, 1.25)
        chosen = bounded_owner(ring, f"s{index}", counts, NODES, 1.25)
        counts[chosen] += 1
        assert counts[chosen] <= capacity
    assert max(counts.values()) <= 1.25 * 1000 / 4 + 1


def test_bounded_placement_skips_full_and_ineligible_backends():
    ring = HashRing(NODES)
    key = "one-session"
    owner, second = list(ring.walk(key))[:2]
    assert bounded_owner(ring, key, {owner: 10}, NODES, 1.0) == second  # owner over its share
    eligible = [n for n in NODES if n != owner]
    assert bounded_owner(ring, key, {}, eligible, 1.25) == second  # owner down


def test_prompt_block_hashes_chain_over_shared_prefixes():
    def body(*contents):
        return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}

    first = prefix_block_hashes(body("a" * 100), block_chars=16)
    longer = prefix_block_hashes(body("a" * 100, "b" * 50), block_chars=16)
    assert len(first) == len(json.dumps(["user", "a" * 100], separators=(",", ":"))) // 16
    assert longer[: len(first)] == first and len(longer) > len(first)
    assert prefix_block_hashes(body("c" + "a" * 99), block_chars=16)[0] != first[0]
    assert prefix_block_hashes({**body("a" * 100), "model": "other"}, block_chars=16)[0] != first[0]
    assert prefix_block_hashes({"model": "m", "prompt": "x" * 40}, block_chars=16) != []


def test_longest_match_takes_the_deepest_unbroken_block():
    assert longest_match([("a", 1.0), ("a", 1.0), ("b", 2.0), None, ("c", 3.0)]) == (("b", 2.0), 3)
    assert longest_match([None, ("a", 1.0)]) == (None, 0)
    assert longest_match([]) == (None, 0)


def test_index_entries_at_or_before_their_backends_horizon_are_gone():
    from kvserve.gateway.prefix import live_entries

    values = ["http://a 10.000", "http://a 20.000", "http://b 5.000", None, "http://c"]
    assert live_entries(values, {"http://a": "10.000"}) == [None, ("http://a", 20.0), ("http://b", 5.0), None, None]


def test_a_prefix_decision_missed_when_the_backend_cached_well_under_its_promise():
    from kvserve.gateway.prefix import cache_counts, prefix_missed

    assert prefix_missed(depth=4, num_blocks=5, prompt_tokens=100, cached_tokens=16)  # promised ~80
    assert not prefix_missed(depth=4, num_blocks=5, prompt_tokens=100, cached_tokens=64)
    assert not prefix_missed(depth=4, num_blocks=5, prompt_tokens=100, cached_tokens=None)  # no usage, no verdict
    assert cache_counts({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}) == (9, 3)
    assert cache_counts({"prompt_tokens": 9}) == (9, None) and cache_counts(None) == (None, None)


def test_health_reads_find_when_a_backend_lost_its_cache():
    from kvserve.gateway.backends import Backend, BackendLoad
    from kvserve.gateway.health import cache_lost

    backend = Backend("http://a")

    def read(at: float, evictions: float, queries: float = 100.0):
        lost = cache_lost(backend, load := BackendLoad(prefix_cache_queries=queries, evictions=evictions,
                                                       capacity_blocks=10), at)
        backend.load = load
        return lost

    assert read(1.0, 0) is None and read(2.0, 4) is None and read(3.0, 9) is None
    assert read(4.0, 12) == (1.0, "evictions")  # a pool's worth (12 - 0) since the read at 1.0, not since 2.0
    assert read(5.0, 12) is None  # nothing new to report
    assert read(6.0, 30) == (5.0, "evictions")
    assert read(7.0, 0, queries=3.0) == (7.0, "restart")  # counters started again: an empty cache


def test_health_reads_the_load_metrics_summed_over_label_sets_and_nothing_else():
    from kvserve.gateway.health import parse_load

    text = "\n".join([
        "# HELP vllm:num_requests_running Running requests.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="odd } name"} 3.0 1700000000000',
        "vllm:num_requests_waiting 4",
        'vllm:num_requests_running_extra{engine="0"} 100.0',
        'vllm:prefix_cache_queries_total{engine="0"} 50.0',
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9',
        'vllm:prefix_cache_hits_total{engine="0"} 20.0',
        'kvserve:kv_cache_capacity_blocks{engine="0"} 844.0',
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 7.0',
        "",
    ])
    load = parse_load(text)
    assert (load.num_running, load.num_waiting, load.prefix_cache_queries, load.prefix_cache_hits,
            load.capacity_blocks, load.kv_cache_usage, load.evictions) == (5.0, 4.0, 50.0, 20.0, 844.0, 0.0, 0.0)


def test_breaker_opens_after_failures_and_closes_after_a_good_trial():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=3, open_s=30.0, clock=lambda: now[0])
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state == CLOSED and breaker.allows_request()
    breaker.on_failure()
    assert breaker.state == OPEN and not breaker.allows_request()
    now[0] = 30.0
    assert breaker.state == HALF_OPEN and breaker.allows_request()
    breaker.on_attempt()
    assert not breaker.allows_request()  # one trial at a time
    breaker.on_failure()
    assert breaker.state == OPEN  # a failed trial opens it again at once
    now[0] = 60.0
    breaker.on_attempt()
    breaker.on_success()
    assert breaker.state == CLOSED and breaker.consecutive_failures == 0


@pytest.mark.parametrize("url, normal", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"), ("http://h:8000/v1/", "http://h:8000"),
    ("https://engine.internal", "https://engine.internal"),
])
def test_backend_urls_are_normalized(url, normal):
    assert normalize_backend_url(url) == normal


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h", "http://", "http://h:99999", "http://h/api"])
def test_bad_backend_urls_are_refused(url):
    with pytest.raises(BadBackendURL):
        normalize_backend_url(url)


def test_sse_events_are_whole_whatever_the_chunking():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'

    async def split(size):
        async def chunks():
            for start in range(0, len(stream), size):
                yield stream[start:start + size]
        return [event async for event in sse_events(chunks())]

    for size in (1, 3, 7, len(stream)):
        assert asyncio.run(split(size)) == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


def test_stream_tap_reads_text_usage_and_withholds_only_the_usage_it_asked_for():
    tap = StreamTap(drop_usage_event=True)
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "Hel"}}, {"index": 1, "delta": {"content": "x"}}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}]
    shown = [tap.read(f"data: {json.dumps(e)}\n\n".encode()) for e in events]
    assert shown == [True, True, True, False]
    assert not tap.done and tap.read(b"data: [DONE]\n\n") and tap.done
    assert (tap.text, tap.total_tokens) == ("Hello", 7)
    completion_tap = StreamTap()
    assert completion_tap.read(b'data: {"choices": [{"index": 0, "text": "abc"}], "usage": {"total_tokens": 3}}\n\n')
    assert completion_tap.text == "abc"


@pytest.fixture()
def store(tmp_path):
    sqlite = SQLiteStore(str(tmp_path / "state.sqlite3"), StoreLimits(conversation_max_messages=4))
    yield sqlite
    asyncio.run(sqlite.close())


def test_keys_are_salted_hashes_and_verify_only_themselves(store):
    async def scenario():
        key, record = await create_key(store, "k")
        other, other_record = await create_key(store, "k")
        assert key_id_of(key) == record.key_id and record.salt != other_record.salt
        assert record.key_hash == hash_key(record.salt, key) and key not in json.dumps(await store.key_list())
        assert (await verify_key(store, key)).key_id == record.key_id
        assert await verify_key(store, key[:-1] + ("A" if key[-1] != "A" else "B")) is None
        assert await verify_key(store, other.replace(other_record.key_id, record.key_id)) is None  # mixed up
        assert await verify_key(store, "kvgw-nope") is None

    asyncio.run(scenario())


def test_rate_windows_count_requests_and_tokens_per_minute(store):
    async def scenario():
        _, key = await create_key(store, "limited", requests_per_minute=2, tokens_per_minute=100)
        start = 6000.0  # the start of a window
        cost = TokenCost(prompt_tokens=10, completion_tokens=20)
        first = await admit(store, key, cost, now=start)
        second = await admit(store, key, cost, now=start + 1)
        third = await admit(store, key, cost, now=start + 2)
        assert (first.exceeded, second.exceeded, third.exceeded) == (None, None, "requests")
        assert third.headers()["x-ratelimit-reset-requests"] == "58s"
        assert (await admit(store, key, cost, now=start + 60)).exceeded is None  # a new window: 30 reserved
        assert (await admit(store, key, TokenCost(10, 61), now=start + 62)).exceeded == "tokens"  # 30 + 71 > 100

    asyncio.run(scenario())


def test_a_conversations_history_is_reserved_before_its_turn_or_refused(store):
    from kvserve.gateway.limits import reserve_more
    from kvserve.gateway.token_budget import TokenReservation

    async def scenario():
        await store.counter_add("k:tokens:1", 30, 65)  # as admission reserved a turn's 10 + 20
        turn = TokenReservation("k:tokens:1", 30, 10)
        fits, too_much = await reserve_more(store, turn, 50, 100), await reserve_more(store, turn, 30, 100)
        await store.counter_add("k:tokens:2", 100, 65)  # a turn without max_tokens took the whole window
        whole = TokenReservation("k:tokens:2", 100, 10, open_ended=True)
        open_fits, open_too_much = await reserve_more(store, whole, 89, 100), await reserve_more(store, whole, 1, 100)
        counters = [await store.counter_get("k:tokens:1"), await store.counter_get("k:tokens:2")]
        return fits, too_much, open_fits, open_too_much, counters, turn.prompt_tokens

    # Counted before the check (the caller refunds a refused one); the whole window already holds a history.
    assert asyncio.run(scenario()) == (True, False, True, False, [110, 100], 90)


def test_chat_fields_a_template_renders_count_toward_the_token_cost():
    from kvserve.gateway.token_budget import request_cost

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "x" * 5000}}]
    extra = request_cost({**body, "tools": tools}, chat=True).prompt_tokens - request_cost(body, chat=True).prompt_tokens
    assert extra > 5000


def test_conversations_keep_order_and_their_bound(store):
    async def scenario():
        await store.conversation_append("c", [{"role": "user", "content": str(i)} for i in range(3)])
        await store.conversation_append("c", [{"role": "user", "content": "3"}, {"role": "user", "content": "4"}])
        return [m["content"] for m in await store.conversation_load("c")]

    assert asyncio.run(scenario()) == ["1", "2", "3", "4"]


def table_rows(path, table: str) -> int:
    with sqlite3.connect(path) as db:
        return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_the_sqlite_store_deletes_what_its_ttls_expire(tmp_path):
    path = tmp_path / "state.sqlite3"
    now = [1000.0]
    limits = StoreLimits(session_ttl_s=300, prefix_ttl_s=100, conversation_ttl_s=200)
    sqlite = SQLiteStore(str(path), limits, clock=lambda: now[0])

    async def fill(tag: str) -> None:
        await sqlite.set_session(f"s-{tag}", "http://a", None)
        await sqlite.prefix_record([f"h-{tag}"], "http://a")
        await sqlite.conversation_append(f"c-{tag}", [{"role": "user", "content": "hi"}])
        await sqlite.counter_add(f"k:tokens:{tag}", 5, 65)
        await sqlite.key_put(f"k-{tag}", {"key_id": f"k-{tag}", "created_at": now[0]})

    def counts() -> list[int]:
        return [table_rows(path, table) for table in ("sessions", "prefixes", "messages", "counters", "api_keys")]

    async def scenario() -> None:
        await fill("old")
        now[0] += 150  # past the counter's and the prefix's TTLs, and a sweep interval
        await fill("new")
        assert counts() == [2, 1, 2, 1, 2]
        now[0] += 160  # the old session (300 s) and conversation (200 s) are past theirs now; the new ones are not
        await sqlite.ping()
        assert counts() == [1, 0, 1, 0, 2]  # API keys never expire
        assert await sqlite.get_session("s-new") == "http://a" and await sqlite.get_session("s-old") is None

    asyncio.run(scenario())
    asyncio.run(sqlite.close())


def test_a_locked_state_file_waits_off_the_event_loop(tmp_path, monkeypatch):
    import kvserve.gateway.sqlite_store

    monkeypatch.setattr(kvserve.gateway.sqlite_store, "BUSY_TIMEOUT_S", 30.0)  # the lock goes before it ends
    path = tmp_path / "state.sqlite3"
    sqlite = SQLiteStore(str(path), StoreLimits())
    other_process = sqlite3.connect(path, isolation_level=None)

    async def scenario() -> None:
        other_process.execute("BEGIN IMMEDIATE")  # another gateway writing, slowly
        write = asyncio.create_task(sqlite.set_session("s", "http://a", None))
        ticked = asyncio.Event()
        asyncio.get_running_loop().call_soon(ticked.set)
        await ticked.wait()  # scheduled after the write: the loop ran on while the write waits
        assert not write.done()
        other_process.execute("ROLLBACK")
        await asyncio.wait_for(write, timeout=30)
        assert await sqlite.get_session("s") == "http://a"

    asyncio.run(scenario())
    asyncio.run(sqlite.close())
    other_process.close()


def test_a_state_file_locked_past_the_busy_timeout_is_store_unavailable(tmp_path):
    from kvserve.gateway.store import StoreUnavailable

    path = tmp_path / "state.sqlite3"
    sqlite = SQLiteStore(str(path), StoreLimits())
    other_process = sqlite3.connect(path, isolation_level=None)

    async def scenario() -> None:
        other_process.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable, match="is busy: another process held its write lock"):
            await sqlite.set_session("s", "http://a", None)
        with pytest.raises(StoreUnavailable, match="is busy"):  # a transaction's BEGIN, its ROLLBACK failing too
            await sqlite.conversation_append("c", [{"role": "user", "content": "hi"}])
        assert await sqlite.get_session("s") is None  # reads go on meanwhile (WAL)
        other_process.execute("ROLLBACK")
        await sqlite.set_session("s", "http://a", None)

    asyncio.run(scenario())
    asyncio.run(sqlite.close())
    other_process.close()


def test_config_file_gives_the_flags_and_the_command_line_wins(tmp_path):
    from kvserve.cli import build_parser
    from kvserve.gateway.cli import settings_from_args

    config = tmp_path / "gateway.yaml"
    config.write_text("backend: [http://a:8000, http://b:8000/v1]\nrouting: round-robin\nload_factor: 1.5\n"
                      "redis-url: redis://r:6379/0\n")
    args = build_parser().parse_args(["gateway", "--config", str(config), "--load-factor", "2",
                                      "--max-attempts", "5", "--breaker-failures", "7"])
    settings = settings_from_args(args)
    assert settings.backends == ["http://a:8000", "http://b:8000"]
    assert (settings.retry.max_attempts, settings.breaker_failures, settings.require_api_key) == (5, 7, True)
    assert (settings.routing.policy, settings.routing.load_factor, settings.redis_url) == (
        "round-robin", 2.0, "redis://r:6379/0")


def test_recent_writes_skip_only_the_same_write_within_the_interval():
    from kvserve.gateway.recent import RecentWrites

    now = [0.0]
    recent = RecentWrites(interval_s=60.0, clock=lambda: now[0])
    assert recent.due("s", "a") and not recent.due("s", "a")
    assert recent.due("s", "b")  # a moved session is a new write
    now[0] = 61.0
    assert recent.due("s", "a")


def queued(url: str, in_flight: int, running: float = 0.0, waiting: float = 0.0):
    from kvserve.gateway.backends import Backend, BackendLoad

    return Backend(url, in_flight=in_flight, load=BackendLoad(num_running=running, num_waiting=waiting))


def test_a_held_session_moves_only_off_a_queue_far_past_the_others():
    from kvserve.gateway.rebalance import rebalance_target

    hot, idle, busy = queued("a", 12), queued("b", 1), queued("c", 5)
    assert rebalance_target(hot, [hot, idle, busy], 1.5, 4) is idle  # 12 > 1.5 x 6: to the shortest queue
    assert rebalance_target(hot, [hot, idle, busy], 2.0, 4) is None  # 12 is not over 2 x 6
    assert rebalance_target(busy, [hot, idle, busy], 1.5, 4) is None  # 5 is under 1.5 x the mean
    assert rebalance_target(hot, [hot, idle, busy], 0.0, 4) is None  # moving for load turned off
    small = queued("a", 3)
    assert rebalance_target(small, [small, queued("b", 0), queued("c", 0)], 1.5, 4) is None  # too few to pay a miss
    # 5 vs 3 is over 1.2 x the mean, but the target with the moved request (4) would be no shorter than what is
    # left (4): the next request would move the session straight back. 6 vs 0 is worth it.
    five, three = queued("a", 5), queued("b", 3)
    assert rebalance_target(five, [five, three], 1.2, 4) is None
    six, none = queued("a", 6), queued("b", 0)
    assert rebalance_target(six, [six, none], 1.5, 4) is none
    # Other replicas' requests, seen in the backend's /metrics, count as much as this replica's own.
    reported = queued("a", 0, running=8, waiting=6)
    assert rebalance_target(reported, [reported, queued("b", 0), queued("c", 1)], 1.5, 4).url == "b"


def test_the_router_moves_a_hot_session_once_and_its_next_requests_follow(tmp_path):
    from kvserve.gateway.request_state import StateQuery
    from kvserve.gateway.routing import Router, RoutingConfig

    backends = [queued(url, 0) for url in ("http://a", "http://b", "http://c")]
    sqlite = SQLiteStore(str(tmp_path / "state.sqlite3"), StoreLimits())
    router = Router(backends, sqlite, RoutingConfig())

    async def scenario():
        first = await router.route("hot", [], set())
        assert first.reason == "session_new"
        # The session's own parallel requests queue its backend: all running (the engine batches them), so it is
        # not saturated, just far busier than the others.
        first.backend.in_flight, first.backend.load.num_running = 10, 10.0
        moved = await router.route("hot", [], set())
        assert moved.reason == "rebalance" and moved.backend is not first.backend
        assert await sqlite.get_session("hot") == moved.backend.url
        moved.backend.in_flight = 3  # the old backend drains while the new one fills: no move back
        assert await router.route("hot", [], set()) == moved.__class__(moved.backend, "session")
        known = await sqlite.read_request_state(StateQuery(session_id="hot"))  # as a request's one read finds it
        assert (await router.route("hot", [], set(), known)).backend is moved.backend

    asyncio.run(scenario())
    asyncio.run(sqlite.close())


def test_a_held_session_stays_on_a_full_pool_and_leaves_a_queue(tmp_path):
    from kvserve.gateway.routing import Router, RoutingConfig

    backends = [queued(url, 0) for url in ("http://a", "http://b", "http://c")]
    sqlite = SQLiteStore(str(tmp_path / "state.sqlite3"), StoreLimits())
    router = Router(backends, sqlite, RoutingConfig())

    async def scenario():
        home = (await router.route("chat", [], set())).backend
        home.load.kv_cache_usage = 0.95  # its pool full of its sessions' caches: past llm-d's 0.8, not a queue
        stay = await router.route("chat", [], set())
        assert (stay.backend, stay.reason) == (home, "session")
        home.load.num_waiting = 6  # requests wait there now: the session leaves, with its history
        moved = await router.route("chat", [], set())
        assert moved.reason == "failover" and moved.backend is not home

    asyncio.run(scenario())
    asyncio.run(sqlite.close())


def needs_redis_server() -> None:
    from gateway_harness import REDIS_CLI, REDIS_SERVER

    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")


async def read_whole_states(store) -> list:
    """A request's state read five ways, after one of everything was stored."""
    await store.key_put("k1", {"key_id": "k1", "created_at": 1})
    await store.counter_add("k1:tokens:7", 40, 65)
    await store.set_session("s1", "http://a", None)
    await store.conversation_append("u/c1", [{"role": "user", "content": "hi"}], "r1")
    await store.prefix_record(["h1", "h2"], "http://a")
    await store.prefix_record(["h3"], "http://b")
    await store.prefix_expire("http://b", time.time() + 60)  # b's entries are gone from its cache
    full = StateQuery(key_id="k1", requests_counter="k1:requests:7", tokens_counter="k1:tokens:7",
                      tokens_limit=100, tokens_cost=TokenCost(10, 20), counter_ttl_s=65, session_id="s1",
                      conversation_id="u/c1", prefix_hashes=["h1", "h2", "h3", "h4"])
    states = [await store.read_request_state(full), await store.read_request_state(full),
              await store.read_request_state(full),
              await store.read_request_state(StateQuery(key_id="nobody", session_id="s2", prefix_hashes=["h9"])),
              await store.read_request_state(StateQuery())]
    await store.close()
    return [(s.key_record, s.requests_used, s.tokens_used, s.tokens_reserved, s.session_backend,
             s.conversation, [e and e[0] for e in s.prefix_entries]) for s in states]


def test_both_stores_read_a_requests_whole_state_alike(tmp_path):
    from gateway_harness import start_redis

    from kvserve.gateway.store import RedisStore

    needs_redis_server()
    redis = start_redis(tmp_path / "redis")
    try:
        from_redis = asyncio.run(read_whole_states(RedisStore(redis.url, StoreLimits())))
        from_sqlite = asyncio.run(read_whole_states(SQLiteStore(str(tmp_path / "state.sqlite3"), StoreLimits())))
    finally:
        redis.stop()
    assert from_redis == from_sqlite
    record = {"key_id": "k1", "created_at": 1}
    conversation = [{"role": "user", "content": "hi"}]
    entries = ["http://a", "http://a", None, None]
    # Each full read reserves 30 tokens of the 100 (40 used before): the third would pass the limit, refused.
    assert from_redis == [(record, 1, 70, 30, "http://a", conversation, entries),
                          (record, 2, 100, 30, "http://a", conversation, entries),
                          (record, 3, 100, 0, "http://a", conversation, entries),
                          (None, 0, 0, 0, None, [], [None]), (None, 0, 0, 0, None, [], [])]


def test_a_redis_cluster_is_found_and_followed_and_every_key_is_in_the_one_slot(tmp_path):
    """Three masters, the URL naming one without the {kvgw} slot (a plain client gets MOVED there): the store finds
    the node to be a cluster node and follows the slot map; every script, transaction and MGET is taken (no
    CROSSSLOT) and reads alike as on one Redis; every key is in the one slot, on the node holding it."""
    from redis import Redis
    from redis.crc import key_slot
    from redis.exceptions import MovedError

    from gateway_harness import start_redis, start_redis_cluster

    from kvserve.gateway.store import RedisStore, connect_store

    needs_redis_server()
    plain = start_redis(tmp_path / "plain")
    try:
        cluster = start_redis_cluster(tmp_path / "cluster")
    except BaseException:
        plain.stop()
        raise

    async def more_writes(store) -> None:  # what read_whole_states does not: a moved session, the counts
        await store.set_session("s1", "http://b", "http://a")
        assert await store.session_counts() == {"http://a": 0, "http://b": 1}
        assert [e and e[0] for e in await store.prefix_lookup(["h1", "h9"])] == ["http://a", None]
        await store.close()

    async def on_cluster(scenario):
        store = await connect_store(cluster.url, "", StoreLimits())
        assert isinstance(store, RedisStore) and store.cluster
        return await scenario(store)

    try:
        with pytest.raises(MovedError):  # what a single-node client meets at this URL
            Redis.from_url(cluster.url).hlen("{kvgw}:keys")
        from_plain = asyncio.run(read_whole_states(RedisStore(plain.url, StoreLimits())))
        assert asyncio.run(on_cluster(read_whole_states)) == from_plain
        asyncio.run(on_cluster(more_writes))
        owner = cluster.owner_of("{kvgw}")
        slots = {key_slot(name.encode()) for name in owner.keys()}
        elsewhere = [name for node in cluster.nodes if node is not owner for name in node.keys()]
    finally:
        plain.stop()
        cluster.stop()
    assert slots == {key_slot(b"{kvgw}")} and elsewhere == []


def test_a_single_redis_is_not_taken_for_a_cluster(tmp_path):
    from gateway_harness import start_redis

    from kvserve.gateway.store import connect_store

    needs_redis_server()
    redis = start_redis(tmp_path / "redis")

    async def cluster_flags() -> list[bool]:
        flags = []
        for mode in ("auto", "no"):
            store = await connect_store(redis.url, "", StoreLimits(), mode)
            flags.append(store.cluster)
            await store.close()
        return flags

    try:
        assert asyncio.run(cluster_flags()) == [False, False]
    finally:
        redis.stop()


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_api_keys_and_conversations_of_the_untagged_layout_are_moved(tmp_path, kind):
    from gateway_harness import start_redis, start_redis_cluster

    from kvserve.gateway.store import connect_store

    needs_redis_server()
    # On a cluster the old names are in other slots than the new ones: moved by copy, not RENAME.
    redis = start_redis(tmp_path / "redis") if kind == "single" else start_redis_cluster(tmp_path / "cluster")
    record = {"key_id": "k1", "created_at": 1}
    redis.cli("HSET", "kvgw:keys", "k1", json.dumps(record))
    redis.cli("RPUSH", "kvgw:conversation:k1/c1", json.dumps({"role": "user", "content": "hi"}))
    redis.cli("EXPIRE", "kvgw:conversation:k1/c1", "500")

    async def scenario():
        store = await connect_store(redis.url, "", StoreLimits())
        moved = [await store.move_old_keys(), await store.move_old_keys()]
        found = (await store.key_get("k1"), await store.conversation_load("k1/c1"))
        await store.close()
        return moved, found

    try:
        moved, found = asyncio.run(scenario())
        ttl = int(redis.cli("TTL", "{kvgw}:conversation:k1/c1"))
        left = redis.keys("kvgw:*")
    finally:
        redis.stop()
    assert moved == [(1, 1), (0, 0)]
    assert found == (record, [{"role": "user", "content": "hi"}])
    assert 0 < ttl <= 500 and left == []


def test_the_start_up_line_masks_the_redis_and_backend_passwords(monkeypatch, caplog):
    import uvicorn

    from kvserve.gateway.cli import serve
    from kvserve.gateway.settings import GatewaySettings

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    settings = GatewaySettings(backends=["http://ops:b4ckend@10.0.0.5:8000"],
                               redis_url="redis://:r3dis@10.0.0.9:6379/0")
    with caplog.at_level(logging.INFO, logger="kvserve.gateway"):
        assert serve(settings, "127.0.0.1", 8080, "info") == 0
    assert "redis://:***@10.0.0.9:6379/0" in caplog.text and "http://ops:***@10.0.0.5:8000" in caplog.text
    assert "r3dis" not in caplog.text and "b4ckend" not in caplog.text


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://user:p@ss@host/0", "redis://user:***@host/0"),
    ("redis://secret@host", "redis://***@host"),
    ("http://host:8000", "http://host:8000"),
    ("rediss://u:p@host?x=@y", "rediss://u:***@host?x=@y"),
])
def test_urls_are_shown_with_their_password_masked(url, shown):
    from kvserve.gateway.urls import redacted_url

    assert redacted_url(url) == shown


def test_both_stores_append_a_request_once_and_trim_keeping_the_system_prompt(tmp_path):
    from gateway_harness import start_redis

    from kvserve.gateway.store import RedisStore

    needs_redis_server()
    redis = start_redis(tmp_path / "redis")
    system = {"role": "system", "content": "Be terse."}

    def turn(index: int) -> list[dict]:
        return [{"role": "user", "content": f"q{index}"}, {"role": "assistant", "content": f"a{index}"}]

    async def scenario(store) -> list[list[str]]:
        seen = []
        await store.conversation_append("c", [system, *turn(0)], "r0")
        await store.conversation_append("c", [system, *turn(0)], "r0")  # a retry: nothing appended
        seen.append([m["content"] for m in await store.conversation_load("c")])
        for index in range(1, 4):  # 7 messages past a bound of 5: the oldest turns go, the system prompt stays
            await store.conversation_append("c", turn(index), f"r{index}")
            seen.append([m["content"] for m in await store.conversation_load("c")])
        await store.conversation_append("c", turn(3), "r3")
        await store.conversation_append("d", [{"role": "user", "content": "x"}] * 7)  # no system prompt to keep
        await store.conversation_append("d", [{"role": "user", "content": "y"}])  # no request id: appended
        seen.append([m["content"] for m in await store.conversation_load("d")])
        await store.close()
        return seen

    limits = StoreLimits(conversation_max_messages=5)
    try:
        from_redis = asyncio.run(scenario(RedisStore(redis.url, limits)))
        from_sqlite = asyncio.run(scenario(SQLiteStore(str(tmp_path / "state.sqlite3"), limits)))
    finally:
        redis.stop()
    assert from_redis == from_sqlite == [
        ["Be terse.", "q0", "a0"],
        ["Be terse.", "q0", "a0", "q1", "a1"],
        ["Be terse.", "q1", "a1", "q2", "a2"],
        ["Be terse.", "q2", "a2", "q3", "a3"],
        ["x", "x", "x", "x", "y"],
    ]
