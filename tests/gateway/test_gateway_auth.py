"""Keys, limits and failures at the edge: keys made with the real CLI and stored as salted hashes only (the
Redis dump holds no key), 401 and 429 in OpenAI's envelope with Retry-After and x-ratelimit-* headers, the
backends' own --api-key, Redis down as a prompt 503, and bad start-up arguments as one-line errors."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from gateway_harness import (
    MODEL_NAME, chat, gateway_settings, needs_redis, redis_fixture, start_backends, start_gateway, stop_all,
)
from server_harness import assert_envelope
from kvserve.server.settings import ServerSettings

pytestmark = needs_redis
BACKEND_KEY = "backend-secret-key"


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    # The backend itself wants a key, which only the gateway knows.
    running = start_backends(tiny_model_dir, 1, settings=ServerSettings(served_model_names=[MODEL_NAME],
                                                                        api_key=BACKEND_KEY))
    yield running[0]
    stop_all(running)


redis = redis_fixture()


@pytest.fixture()
def gateway(backend, redis):
    running = start_gateway(gateway_settings([backend.url], redis_url=redis.url, require_api_key=True,
                                             backend_api_key=BACKEND_KEY))
    yield running
    running.stop()


def kvserve_gateway(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "gateway", *args], capture_output=True, text=True,
                          timeout=60)


def create_key(redis, *limits: str) -> tuple[str, str]:
    """(key, key id) from `kvserve gateway keys create`."""
    result = kvserve_gateway("keys", "create", "--name", "test", *limits, "--redis-url", redis.url)
    assert result.returncode == 0, result.stderr
    key = result.stdout.splitlines()[0]
    return key, key.split("-")[1]


def fresh_rate_window() -> None:
    """Limits count per clock minute: a test that needs several requests in one window starts early in one."""
    into_window = time.time() % 60
    if into_window > 45:
        time.sleep(60 - into_window + 0.1)


def post_chat(gateway, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway.base_url}/chat/completions", headers=headers, timeout=30,
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_missing_wrong_and_revoked_keys_get_401_in_the_envelope(gateway, redis):
    key, key_id = create_key(redis)
    assert chat(gateway, "hello", api_key=key)[0].choices  # the gateway's key in, the backend's key out
    for bad in (None, "sk-not-a-gateway-key", key[:-1] + ("A" if key[-1] != "A" else "B")):
        error = assert_envelope(post_chat(gateway, bad), 401)
        assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        chat(gateway, "hello", api_key="wrong")
    revoked = kvserve_gateway("keys", "revoke", key_id, "--redis-url", redis.url)
    assert revoked.returncode == 0, revoked.stderr
    assert assert_envelope(post_chat(gateway, key), 401)["code"] == "invalid_api_key"
    listing = kvserve_gateway("keys", "list", "--redis-url", redis.url).stdout
    assert key_id in listing and "revoked" in listing and key not in listing


def test_requests_per_minute_limit_is_a_429_with_headers(gateway, redis):
    key, _ = create_key(redis, "--rpm", "2")
    fresh_rate_window()
    first, second, third = (post_chat(gateway, key) for _ in range(3))
    assert (first.status_code, second.status_code) == (200, 200)
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
    error = assert_envelope(third, 429)
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert 1 <= int(third.headers["retry-after"]) <= 60
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError):
        chat(gateway, "again", api_key=key)


def test_tokens_per_minute_counts_streams_without_showing_the_client_usage(gateway, redis):
    # The stream reserves 47 tokens (its prompt's bytes, the template's, max_tokens) and is settled to its usage,
    # about 30; the next request's 32 no longer fit in 50.
    key, _ = create_key(redis, "--tpm", "50")
    fresh_rate_window()
    chunks = list(gateway.openai(key).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "count my tokens"}], max_tokens=4, stream=True))
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)  # usage asked by the gateway
    error = assert_envelope(post_chat(gateway, key), 429)
    assert error["type"] == "tokens"
    assert int(post_chat(gateway, key).headers["x-ratelimit-remaining-tokens"]) < 32


def test_redis_holds_no_key_only_salted_hashes(gateway, redis):
    key, key_id = create_key(redis, "--rpm", "100")
    assert post_chat(gateway, key).status_code == 200
    secret = key.split("-", 2)[2]
    values = []
    for name in redis.cli("KEYS", "*").split():
        kind = redis.cli("TYPE", name).strip()
        command = {"string": ["GET"], "hash": ["HGETALL"], "list": ["LRANGE"], "zset": ["ZRANGE"],
                   "set": ["SMEMBERS"]}[kind]
        values.append(name + redis.cli(*command, name, *(["0", "-1"] if kind in ("list", "zset") else [])))
    stored = "\n".join(values)
    assert key_id in stored and "key_hash" in stored  # the record is there...
    assert key not in stored and secret not in stored  # ...but not the key
    redis.cli("SAVE")
    dump = (redis.directory / "dump.rdb").read_bytes()
    assert key_id.encode() in dump and secret.encode() not in dump


def test_redis_down_is_a_prompt_503_in_the_envelope(gateway, redis):
    key, _ = create_key(redis)
    assert post_chat(gateway, key).status_code == 200
    redis.stop()
    error = assert_envelope(post_chat(gateway, key), 503)  # httpx's 30 s timeout would fail a hang
    assert error["code"] == "store_unavailable" and "Redis" in error["message"]
    assert assert_envelope(httpx.get(f"{gateway.url}/health", timeout=30), 503)["code"] == "store_unavailable"


@pytest.mark.parametrize("args, says", [
    (["--backend", "localhost:8000"], "is not an http(s)://host[:port] URL"),
    (["--backend", "http://127.0.0.1:1"], "backend http://127.0.0.1:1 is unreachable"),
    ([], "give at least one --backend URL"),
])
def test_bad_backend_at_start_is_a_one_line_error(args, says, tmp_path):
    result = kvserve_gateway(*args, "--state-path", str(tmp_path / "gw.sqlite3"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


def test_redis_unreachable_at_start_is_a_one_line_error(backend, tmp_path):
    result = kvserve_gateway("--backend", backend.url, "--backend-api-key", BACKEND_KEY,
                             "--redis-url", "redis://127.0.0.1:1/0")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Redis at redis://127.0.0.1:1/0 is unavailable" in result.stderr


def test_gateway_imports_nothing_of_the_engine():
    code = ("import sys, kvserve.gateway.app, kvserve.gateway.cli, kvserve.gateway.keys_cli; "
            "print([m for m in sys.modules if m.split('.')[:2] in (['kvserve','engine'], ['kvserve','model'], "
            "['kvserve','cache']) or m == 'torch'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_the_command_serves_with_a_key_from_the_same_store_and_stops_cleanly(backend, tmp_path):
    import signal

    from ports import free_port
    from server_harness import wait_until

    state = ["--state-path", str(tmp_path / "gw.sqlite3")]
    key = kvserve_gateway("keys", "create", "--name", "cli", *state).stdout.splitlines()[0]
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "gateway", "--backend", backend.url,
                                "--backend-api-key", BACKEND_KEY, "--host", "127.0.0.1", "--port", str(port),
                                *state], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout_s=30), "the gateway did not come up"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert reply.choices[0].message.content is not None
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output


def test_a_conversation_belongs_to_the_key_that_started_it(gateway, redis):
    owner, _ = create_key(redis)
    other, _ = create_key(redis)

    def turn(key: str, content: str) -> httpx.Response:
        return httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": MODEL_NAME, "conversation": "shared-name", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": content}]})

    def history(key: str) -> httpx.Response:
        return httpx.get(f"{gateway.base_url}/conversations/shared-name", headers={"Authorization": f"Bearer {key}"},
                         timeout=30)

    assert turn(owner, "the owner's secret plan").status_code == 200
    assert assert_envelope(history(other), 404)["code"] == "conversation_not_found"  # not even its existence
    assert turn(other, "someone else").status_code == 200  # the same name starts the other key's own
    assert [m["content"] for m in history(other).json()["messages"]][0] == "someone else"
    assert [m["content"] for m in history(owner).json()["messages"]][0] == "the owner's secret plan"


def redis_command_calls(redis) -> dict[str, int]:
    calls = {}
    for line in redis.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line[len("cmdstat_"):].partition(":")
            calls[name] = int(dict(f.split("=") for f in fields.split(","))["calls"])
    return calls


def test_a_completion_with_a_known_key_reads_its_state_in_one_round_trip(gateway, redis):
    key, _ = create_key(redis, "--rpm", "1000")

    def post() -> httpx.Response:
        return httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          timeout=30, json={"model": MODEL_NAME, "user": "one-trip", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]})

    # The first verifies the key and places the session, the second refreshes the session's TTL (once a minute).
    assert [post().status_code for _ in range(2)] == [200, 200]
    redis.cli("CONFIG", "RESETSTAT")
    assert [post().status_code for _ in range(3)] == [200, 200, 200]
    calls = redis_command_calls(redis)
    for own in ("info", "config|resetstat"):  # the test's own commands
        calls.pop(own, None)
    # One script call a request, and in it: the key's record (a revocation shows at once), the request counted in
    # its window with the window's expiry, and the session's backend.
    assert calls == {"evalsha": 3, "hget": 3, "incrby": 3, "expire": 3, "get": 3}


def test_two_keys_naming_the_same_session_get_two_sessions(gateway, redis):
    """A client's own session id (x-session-id or `user`) is scoped to its key under --cache-sharing key: two
    tenants that both say "alice" are routed as two sessions, so neither steers the other's placement or learns
    from x-kvserve-backend where the other's session lives."""
    (first, first_id), (second, second_id) = create_key(redis), create_key(redis)
    for key in (first, second):
        chat(gateway, "hello", api_key=key, extra_headers={"X-Session-ID": "alice"})
        chat(gateway, "hello again", api_key=key, user="alice")
    sessions = sorted(redis.cli("--scan", "--pattern", "{kvgw}:session:*").split())
    assert sessions == sorted(f"{{kvgw}}:session:{kind}:{key_id}:alice"
                              for kind in ("header", "user") for key_id in (first_id, second_id))
