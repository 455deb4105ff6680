"""Routing through a real gateway over three real kvserve backends, state in a real redis-server: sessions stick,
bounded load moves new sessions and never held ones, prefixes follow their cache, and a restarted gateway (or a
second replica) routes every session where it was."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from gateway_harness import backends_fixture, chat, gateway_settings, metric, needs_redis, redis_fixture, start_gateway
from kvserve.gateway.hashring import HashRing, share_capacity

pytestmark = needs_redis

BACKEND_HEADER = "x-kvserve-backend"
ROUTE_HEADER = "x-kvserve-route"

backends = backends_fixture(3)
redis = redis_fixture()


def test_sessions_stick_by_header_and_by_user(backends, redis):
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url))
    try:
        first_backend: dict[str, str] = {}
        for round_index in range(3):
            for index in range(6):
                session = f"s{index}"
                _, headers = chat(gateway, f"round {round_index}: hello", extra_headers={"X-Session-ID": session})
                first_backend.setdefault(session, headers[BACKEND_HEADER])
                assert headers[BACKEND_HEADER] == first_backend[session]
                assert headers[ROUTE_HEADER] in (("session",) if round_index else ("session_new", "bounded"))
        assert len(set(first_backend.values())) > 1  # six sessions spread, not piled on one backend
        users = [chat(gateway, f"turn {turn}", user="alice")[1][BACKEND_HEADER] for turn in range(3)]
        assert len(set(users)) == 1
        assert metric(gateway.metrics(), "kvserve:gateway_routing_decisions_total", reason="session") == 14
    finally:
        gateway.stop()


def test_bounded_load_moves_new_sessions_never_held_ones(backends, redis):
    urls = [b.url for b in backends]
    gateway = start_gateway(gateway_settings(urls, redis_url=redis.url))
    ring = HashRing(urls)
    crowded = urls[0]
    # Sessions whose ring owner is the same backend (the gateway namespaces header sessions): without the
    # bound they would all land there.
    sessions = [f"crowd-{i}" for i in range(400) if ring.owner(f"header:crowd-{i}") == crowded][:9]
    try:
        placed = {}
        for index, session in enumerate(sessions):
            _, headers = chat(gateway, "hi", extra_headers={"X-Session-ID": session})
            placed[session] = headers[BACKEND_HEADER]
            counts = {url: list(placed.values()).count(url) for url in urls}
            # Never more than its share, taken before this placement (+1 for the session being placed).
            before = {**counts, placed[session]: counts[placed[session]] - 1}
            assert counts[placed[session]] <= share_capacity(before, urls, gateway.settings.routing.load_factor)
        # All nine want the same backend; the bound (1.0 x the mean) spreads them three a backend...
        assert sorted(counts.values()) == [3, 3, 3] and counts[crowded] == 3
        samples = gateway.metrics()  # three took their owner, six went on round the ring
        assert metric(samples, "kvserve:gateway_routing_decisions_total", reason="session_new") == 3
        assert metric(samples, "kvserve:gateway_routing_decisions_total", reason="bounded") == 6
        for session in sessions:  # ...and every session, moved or not, stays where it was placed
            _, headers = chat(gateway, "again", extra_headers={"X-Session-ID": session})
            assert (headers[BACKEND_HEADER], headers[ROUTE_HEADER]) == (placed[session], "session")
    finally:
        gateway.stop()


def test_sessions_arriving_together_are_spread_too(backends, redis):
    urls = [b.url for b in backends]
    gateway = start_gateway(gateway_settings(urls, redis_url=redis.url))
    ring = HashRing(urls)
    sessions = [f"burst-{i}" for i in range(400) if ring.owner(f"header:burst-{i}") == urls[1]][:9]
    try:
        with ThreadPoolExecutor(len(sessions)) as pool:  # all nine new sessions in flight at once
            placed = list(pool.map(lambda s: chat(gateway, "hi", extra_headers={"X-Session-ID": s})[1][BACKEND_HEADER],
                                   sessions))
        assert sorted(placed.count(url) for url in urls) == [3, 3, 3]
    finally:
        gateway.stop()


def test_requests_without_session_follow_their_prefix(backends, redis):
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=redis.url,
                                             prefix_block_chars=32))
    system = "You are a careful assistant who answers about KV caches. " * 2
    try:
        served = []
        for question in ("what is a block?", "what is a hash?", "what is eviction?"):
            raw = gateway.openai().chat.completions.with_raw_response.create(
                model="tiny-llama", max_tokens=2,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            served.append((raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER]))
        assert served[0][1] == "load"
        assert served[1:] == [(served[0][0], "prefix")] * 2
    finally:
        gateway.stop()


def test_restarted_gateway_and_second_replica_route_every_session_where_it_was(backends, redis):
    urls = [b.url for b in backends]
    first = start_gateway(gateway_settings(urls, redis_url=redis.url))
    try:
        placed = {f"r{i}": chat(first, "hi", extra_headers={"X-Session-ID": f"r{i}"})[1][BACKEND_HEADER]
                  for i in range(8)}
    finally:
        first.stop()
    # Backends listed in another order: the ring is the same, and the stored map decides anyway.
    restarted = start_gateway(gateway_settings(list(reversed(urls)), redis_url=redis.url))
    replica = start_gateway(gateway_settings(urls, redis_url=redis.url))
    try:
        for session, backend in placed.items():
            for gateway in (restarted, replica):
                _, headers = chat(gateway, "back again", extra_headers={"X-Session-ID": session})
                assert (headers[BACKEND_HEADER], headers[ROUTE_HEADER]) == (backend, "session")
    finally:
        restarted.stop()
        replica.stop()


def test_sqlite_store_survives_a_restart_too(backends, tmp_path):
    urls = [b.url for b in backends]
    state_path = str(tmp_path / "gateway.sqlite3")
    first = start_gateway(gateway_settings(urls, state_path=state_path))
    try:
        placed = {f"q{i}": chat(first, "hi", extra_headers={"X-Session-ID": f"q{i}"})[1][BACKEND_HEADER]
                  for i in range(5)}
    finally:
        first.stop()
    restarted = start_gateway(gateway_settings(urls, state_path=state_path))
    try:
        for session, backend in placed.items():
            assert chat(restarted, "again", extra_headers={"X-Session-ID": session})[1][BACKEND_HEADER] == backend
    finally:
        restarted.stop()
