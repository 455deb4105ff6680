"""Disconnects free blocks, a full queue sheds load, a failing engine answers instead of hanging, the API key
guards /v1, draining refuses new work."""

import asyncio
import json
import socket

import httpx
import pytest
from server_harness import MODEL_NAME, assert_envelope, slowed, start_server, wait_until

from kvserve.engine.async_engine import EngineState
from kvserve.server.settings import ServerSettings

LONG = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 240, "ignore_eos": True}


@pytest.fixture
def slow_steps(server, monkeypatch):
    monkeypatch.setattr(server.engine.engine, "step", slowed(server.engine.engine.step))


def aborted(server) -> float:
    return server.metrics()["vllm:request_success_total{finished_reason=abort}"]


def completed(server) -> float:
    return server.metrics()["vllm:request_success_total{finished_reason=length}"]


def engine_idle_and_blocks_free(server) -> bool:
    metrics = server.metrics()
    return metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0.0


def test_stream_disconnect_aborts_and_frees_blocks(server, slow_steps):
    before, completed_before = aborted(server), completed(server)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.metrics()["vllm:num_requests_running"] == 1
        # Leaving the block closes the connection with the stream unread.
    assert wait_until(lambda: engine_idle_and_blocks_free(server), timeout_s=5)
    metrics = server.metrics()
    assert metrics["vllm:request_success_total{finished_reason=abort}"] == before + 1
    assert metrics["vllm:request_success_total{finished_reason=length}"] == completed_before  # it never ran to the end
    assert server.engine.engine.kv_cache.num_free_blocks == server.engine.engine.kv_cache.num_blocks


def test_non_stream_disconnect_aborts_and_frees_blocks(server, slow_steps):
    before, completed_before = aborted(server), completed(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.3))
    assert wait_until(lambda: aborted(server) == before + 1, timeout_s=5)
    assert wait_until(lambda: engine_idle_and_blocks_free(server), timeout_s=5)
    assert completed(server) == completed_before


def test_engine_failure_fails_requests_and_service_recovers(server, monkeypatch):
    engine = server.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    response = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 20}, timeout=30)
    error = assert_envelope(response, 500)
    assert error["code"] == "engine_error" and "simulated device fault" in error["message"]
    calls["n"] = -10**9  # no more faults
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "max_tokens": 5, "stream": True},
                      timeout=30) as stream_response:
        assert stream_response.status_code == 200
        assert "data: [DONE]" in stream_response.read().decode()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert engine_idle_and_blocks_free(server)


def test_engine_failure_mid_stream_sends_an_error_event(server, monkeypatch):
    engine = server.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated fault mid-stream")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "max_tokens": 50, "stream": True},
                      timeout=30) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "engine_error"


def test_draining_refuses_new_requests(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    running = start_server(folder)
    try:
        running.engine.stop_admitting()
        error = assert_envelope(httpx.post(f"{running.url}/v1/completions", json={"prompt": "hi"}, timeout=30), 503)
        assert error["code"] == "server_shutting_down"
        assert httpx.get(f"{running.url}/health").status_code == 503
        assert running.engine.state is EngineState.DRAINING
    finally:
        running.stop()


def test_full_waiting_queue_gets_503_with_retry_after(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, max_waiting_requests=1, max_num_seqs=1)
    running.engine.engine.step = slowed(running.engine.engine.step)

    async def burst():
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            body = {**LONG, "max_tokens": 40}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))

    try:
        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        rejected = next(r for r in responses if r.status_code == 503)
        assert rejected.headers["retry-after"] == "1"
        assert assert_envelope(rejected, 503)["code"] == "queue_full"
        metrics = running.metrics()
        assert metrics["kvserve:requests_rejected_total{reason=queue_full}"] == statuses.count(503)
        assert httpx.post(f"{running.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        running.stop()


def test_api_key_guards_v1_only(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, ServerSettings(served_model_names=[MODEL_NAME], api_key="sekret"))
    try:
        url = f"{running.url}/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        assert assert_envelope(httpx.post(url, json=body), 401)["code"] == "invalid_api_key"
        assert_envelope(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_envelope(httpx.get(f"{running.url}/v1/models"), 401)
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        for open_path in ("/health", "/metrics", "/version"):
            assert httpx.get(running.url + open_path).status_code == 200
        assert running.openai(api_key="sekret").models.list().data[0].id == MODEL_NAME
        import openai

        with pytest.raises(openai.AuthenticationError):
            running.openai(api_key="wrong").models.list()
        assert_auth_scheme_is_case_insensitive(running)
    finally:
        running.stop()


def assert_auth_scheme_is_case_insensitive(running) -> None:
    """HTTP auth schemes are case-insensitive (RFC 7235): any case of `Bearer`, any whitespace after it; the key
    itself must match exactly."""
    url = f"{running.url}/v1/models"
    for header in ("bearer sekret", "BEARER sekret", "bEaReR sekret", "Bearer   sekret", "bearer\tsekret"):
        assert httpx.get(url, headers={"Authorization": header}).status_code == 200, header
    for header in ("bearer Sekret", "bearer sekret2", "Basic sekret", "Bearersekret", "sekret", "bearer"):
        assert_envelope(httpx.get(url, headers={"Authorization": header}), 401)
    # Whitespace around the value, which an HTTP client library will not send: written on the socket by hand.
    host, port = running.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: \t bearer  sekret \t\r\n"
                           b"Connection: close\r\n\r\n")
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_http_stays_responsive_while_the_engine_works(server, monkeypatch):
    """The engine steps in its own thread: /health answers in the middle of a generation, while that request is
    still running (its 240 steps of at least 50 ms make it last 12 s or more; the test disconnects long before)."""
    monkeypatch.setattr(server.engine.engine, "step", slowed(server.engine.engine.step, 0.05))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()  # kept: a discarded iterator closes the stream, which aborts it
            assert next(lines).startswith("data: ")
            # The first token can reach us before the engine thread publishes its snapshot.
            assert wait_until(lambda: server.metrics()["vllm:num_requests_running"] == 1, timeout_s=5)
            for _ in range(5):
                assert client.get("/health").status_code == 200
                assert server.metrics()["vllm:num_requests_running"] == 1  # answered mid-generation
        # Leaving the block disconnects: the request is aborted, not waited for.
    assert wait_until(lambda: engine_idle_and_blocks_free(server), timeout_s=5)
