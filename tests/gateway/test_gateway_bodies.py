"""Bodies at the gateway: read with a cap (a 256 MiB POST is a 413 in the envelope while the gateway's memory
barely moves, declared or chunked), and judged as the backend judges them (`"stream": "false"` is no stream, so a
healthy backend is never marked failed for it; a wrong type is a 400 in the envelope, never a 500)."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest

from gateway_harness import (
    MODEL_NAME, backends_fixture, free_port, gateway_settings, metric, start_gateway,
)
from server_harness import assert_envelope, wait_until

backends = backends_fixture(1)
MiB = 2**20


@pytest.fixture(scope="module")
def gateway(backends, tmp_path_factory):
    running = start_gateway(gateway_settings([backends[0].url],
                                             state_path=str(tmp_path_factory.mktemp("gw") / "gw.sqlite3")))
    yield running
    running.stop()


def post_json(gateway, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=30)


def chat_body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def test_stream_false_as_a_string_is_no_stream_and_no_backend_failure(gateway, backends):
    for _ in range(gateway.settings.breaker_failures + 1):
        response = post_json(gateway, chat_body(stream="false"))
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["object"] == "chat.completion"
    samples = gateway.metrics()
    assert metric(samples, "kvserve:gateway_breaker_state", backend=backends[0].url) == 0
    assert metric(samples, "kvserve:gateway_requests_total", backend=backends[0].url, outcome="backend_error") == 0


@pytest.mark.parametrize("fields, param", [
    ({"messages": 5}, "messages"),
    ({"stream_options": "x", "stream": True}, "stream_options"),
    ({"stream": "x"}, "stream"),
    ({"stream": 5}, "stream"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"max_tokens": "many"}, "max_tokens"),
])
def test_wrong_types_are_a_400_in_the_envelope(gateway, fields, param):
    error = assert_envelope(post_json(gateway, chat_body(**fields)), 400)
    assert error["param"] == param


def test_completion_prompt_of_a_wrong_type_is_a_400(gateway):
    response = httpx.post(f"{gateway.base_url}/completions", timeout=30,
                          json={"model": MODEL_NAME, "prompt": {"not": "a prompt"}, "max_tokens": 2})
    assert assert_envelope(response, 400)["param"] == "prompt"


def test_a_body_over_the_flag_is_a_413(backends, tmp_path):
    small = start_gateway(gateway_settings([backends[0].url], state_path=str(tmp_path / "gw.sqlite3"),
                                           max_request_bytes=1000))
    try:
        error = assert_envelope(post_json(small, chat_body(messages=[{"role": "user", "content": "x" * 2000}])), 413)
        assert error["code"] == "request_too_large"
        assert post_json(small, chat_body()).status_code == 200
    finally:
        small.stop()


# --- 256 MiB against a gateway in its own process, so its memory is its own ---

@pytest.fixture(scope="module")
def gateway_process(backends, tmp_path_factory):
    port = free_port()
    state = tmp_path_factory.mktemp("gw-process") / "gw.sqlite3"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "gateway", "--backend", backends[0].url, "--disable-auth",
         "--host", "127.0.0.1", "--port", str(port), "--state-path", str(state), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(healthy, timeout_s=60), "the gateway did not start"
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def memory_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def post_streamed_body(url: str, total_bytes: int, chunked: bool) -> tuple[int, bytes, int]:
    """POSTs `total_bytes` of body from one reused 1 MiB chunk (the test never holds the body), stopping as soon
    as the gateway answers or closes: (status, response bytes, body bytes sent)."""
    parts = urlsplit(url)
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total_bytes}\r\n".encode()
    chunk = b"x" * MiB
    wire_chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
    sent = 0
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     + framing + b"\r\n")
        try:
            while sent < total_bytes and not select.select([sock], [], [], 0)[0]:
                sock.sendall(wire_chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed; its answer is still to be read
        response = b""
        while b"\r\n\r\n" not in response or len(response) < _expected_length(response):
            data = sock.recv(65536)
            if not data:
                break
            response += data
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1], sent


def _expected_length(response: bytes) -> int:
    head, _, _ = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_256_mib_body_is_a_413_and_the_gateway_memory_stays_bounded(gateway_process, chunked):
    url, pid = gateway_process
    before_kib = memory_kib(pid, "VmRSS")
    status, body, sent = post_streamed_body(url, 256 * MiB, chunked)
    peak_kib = memory_kib(pid, "VmHWM")
    assert status == 413, body[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert sent < 256 * MiB  # refused before the body was all sent
    assert (peak_kib - before_kib) / 1024 < 200, f"RSS grew {(peak_kib - before_kib) / 1024:.0f} MiB"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # and it still serves
    assert os.path.exists(f"/proc/{pid}")
