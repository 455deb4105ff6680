"""The gateway's upstream rules against stub backends that misbehave on purpose: a 503 before the first byte is
sent to another backend; a backend that takes the request and then says nothing is a 502 after the upstream
timeout, never resent (it may be working on it); a client that leaves mid-stream closes the upstream connection.
(A backend killed outright, and a real engine's abort, are in test_gateway_failover.py and
test_gateway_conversations.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway_harness import gateway_settings, metric, start_gateway
from server_harness import assert_envelope, serve_in_thread, wait_until

COMPLETION = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class StubBackend:
    """A backend whose /v1/completions does what `answer` says; it counts the completions it was sent and notes
    when a stream's client went away."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.completions = 0
        self.stream_closed = threading.Event()
        self.request_closed = threading.Event()  # a "hang" request's client (the gateway) closed its connection

        async def completions(request: Request) -> Response:
            await request.body()
            self.completions += 1
            if self.answer == "busy":
                return JSONResponse({"error": {"message": "queue full"}}, status_code=503)
            if self.answer == "silent":
                await asyncio.sleep(30)
            if self.answer == "hang":  # as an engine still generating: it answers when its client has left
                await asyncio.wait_for(_disconnected(request), timeout=30)
                self.request_closed.set()
                return Response(status_code=499)
            if self.answer == "stream":
                return StreamingResponse(self._events(), media_type="text/event-stream")
            return JSONResponse(COMPLETION)

        routes = [Route("/health", lambda request: PlainTextResponse("ok")),
                  Route("/metrics", lambda request: PlainTextResponse("")),
                  Route("/v1/completions", completions, methods=["POST"])]
        self.url, self.server, self.thread = serve_in_thread(Starlette(routes=routes), shutdown_timeout_s=1.0)

    async def _events(self):
        try:
            for index in range(1000):
                chunk = {**COMPLETION, "choices": [{"index": 0, "text": f"t{index}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.02)
        finally:  # the stream's task is cancelled when its client (the gateway) drops the connection
            self.stream_closed.set()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def started(*answers: str) -> list[StubBackend]:
    return [StubBackend(answer) for answer in answers]


def post(gateway, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/completions", json=body or {"model": "stub", "prompt": "hi"}, timeout=30)


def test_a_503_before_the_first_byte_goes_to_another_backend(tmp_path):
    busy, good = stubs = started("busy", "ok")
    gateway = start_gateway(gateway_settings([s.url for s in stubs], state_path=str(tmp_path / "gw.sqlite3"),
                                             routing=_round_robin()))
    try:
        for _ in range(4):  # round robin starts each at the busy one (its retry moves the cycle to the other)
            response = post(gateway)
            assert response.status_code == 200 and response.json() == COMPLETION
            assert response.headers["x-kvserve-backend"] == good.url
        samples = gateway.metrics()
        assert busy.completions >= 1 and good.completions == 4
        assert metric(samples, "kvserve:gateway_retries_total", backend=busy.url) == busy.completions
        assert metric(samples, "kvserve:gateway_requests_total", backend=good.url, outcome="success") == 4
    finally:
        gateway.stop()
        for stub in stubs:
            stub.stop()


def test_a_backend_silent_past_the_upstream_timeout_is_a_502_never_resent(tmp_path):
    silent, good = stubs = started("silent", "ok")
    gateway = start_gateway(gateway_settings([s.url for s in stubs], state_path=str(tmp_path / "gw.sqlite3"),
                                             routing=_round_robin(), upstream_timeout_s=0.5))
    try:
        responses = [post(gateway), post(gateway)]  # round robin: one of them goes to the silent backend first
        assert sorted(r.status_code for r in responses) == [200, 502]
        error = assert_envelope(next(r for r in responses if r.status_code == 502), 502)
        assert error["code"] == "backend_error"
        assert silent.completions == 1 and good.completions == 1  # the timed-out request was not sent again
        assert metric(gateway.metrics(), "kvserve:gateway_retries_total", backend=silent.url) == 0
    finally:
        gateway.stop()
        for stub in stubs:
            stub.stop()


def test_a_client_leaving_mid_stream_closes_the_upstream_connection(tmp_path):
    (stub,) = started("stream")
    gateway = start_gateway(gateway_settings([stub.url], state_path=str(tmp_path / "gw.sqlite3")))
    try:
        body = {"model": "stub", "prompt": "hi", "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ") and next(l for l in lines if l).startswith("data: ")
            assert not stub.stream_closed.is_set()
        assert stub.stream_closed.wait(timeout=10)  # long before its 1,000 events (20 s) were sent
        assert wait_until(lambda: metric(gateway.metrics(), "kvserve:gateway_requests_total", backend=stub.url,
                                         outcome="client_disconnected") == 1)
    finally:
        gateway.stop()
        stub.stop()


def test_a_client_leaving_before_a_whole_answer_closes_the_upstream_connection(tmp_path):
    (stub,) = started("hang")
    gateway = start_gateway(gateway_settings([stub.url], state_path=str(tmp_path / "gw.sqlite3")))
    try:
        body = json.dumps({"model": "stub", "prompt": "hi"}).encode()
        host, port = gateway.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_until(lambda: stub.completions == 1)  # the backend is at work on it
            assert not stub.request_closed.is_set()
        assert stub.request_closed.wait(timeout=10)  # the gateway dropped its request, long before 30 s
        # No backend answered (its answer's headers come with the whole answer): counted as such.
        assert wait_until(lambda: metric(gateway.metrics(), "kvserve:gateway_requests_total", backend="none",
                                         outcome="client_disconnected") == 1)
    finally:
        gateway.stop()
        stub.stop()


def with_password(url: str) -> str:
    return url.replace("http://", "http://operator:s3cret@")


def test_backend_passwords_are_masked_in_headers_health_metrics_and_errors(tmp_path):
    ok, busy = stubs = started("ok", "busy")
    serving = start_gateway(gateway_settings([with_password(ok.url)], state_path=str(tmp_path / "a.sqlite3")))
    refusing = start_gateway(gateway_settings([with_password(busy.url)], state_path=str(tmp_path / "b.sqlite3")))
    masked = with_password(ok.url).replace("s3cret", "***")
    try:
        answered = post(serving)
        assert answered.status_code == 200 and answered.headers["x-kvserve-backend"] == masked
        assert httpx.get(f"{serving.url}/health", timeout=10).json()["backends_up"] == [masked]
        metrics_text = httpx.get(f"{serving.url}/metrics", timeout=10).text
        assert f'backend="{masked}"' in metrics_text
        error = assert_envelope(post(refusing), 503)
        assert "operator:***@" in error["message"]
        assert "s3cret" not in httpx.get(f"{refusing.url}/metrics", timeout=10).text + error["message"] + metrics_text
    finally:
        for gateway in (serving, refusing):
            gateway.stop()
        for stub in stubs:
            stub.stop()


def test_the_completion_routes_fast_path_answers_like_fastapi(tmp_path, monkeypatch):
    import kvserve.gateway.app

    (stub,) = started("ok")
    gateway = start_gateway(gateway_settings([stub.url], state_path=str(tmp_path / "gw.sqlite3")))
    try:
        assert post(gateway).json() == COMPLETION
        wrong_method = httpx.get(f"{gateway.base_url}/completions", timeout=10)
        assert "not allowed" in assert_envelope(wrong_method, 405)["message"]
        assert assert_envelope(httpx.post(f"{gateway.base_url}/completions/x", timeout=10), 404)
        not_json = httpx.post(f"{gateway.base_url}/chat/completions", content=b"{", timeout=10)
        assert assert_envelope(not_json, 400)["message"].startswith("the request body is not valid JSON")

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(kvserve.gateway.app, "forward_completion", broken)
        assert assert_envelope(post(gateway), 500)["message"] == "internal server error: RuntimeError"
    finally:
        gateway.stop()
        stub.stop()


def _round_robin():
    from kvserve.gateway.routing import RoutingConfig

    return RoutingConfig(policy="round-robin")
