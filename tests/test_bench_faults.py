"""The load tester against servers that misbehave, and its open-loop arrivals, on small HTTP apps these tests
start themselves (no model, so only the load tester's behaviour is measured)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.bench.runner import BenchConfig, run_benchmark

TOKENS_PER_ANSWER = 3


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def completion_events(prompt: str) -> list[str]:
    events = [sse({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
              for i in range(TOKENS_PER_ANSWER)]
    events.append(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    events.append(sse({"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens":
                                                TOKENS_PER_ANSWER, "total_tokens": 0}}))
    return events + ["data: [DONE]\n\n"]


class FakeOpenAI:
    """/v1/completions whose behaviour is chosen by the request's `model`; records each arrival time."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        behaviour, prompt = body["model"], body.get("prompt", "")
        if behaviour == "stall":
            await asyncio.sleep(3600)
        if behaviour == "http500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "param": None,
                                           "code": None}}, status_code=500)
        if behaviour == "garbage":
            return PlainTextResponse("this is not a stream\n")
        if not body.get("stream"):  # the calibration probe
            return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(prompt.split())}})
        return StreamingResponse(self.events(behaviour, prompt), media_type="text/event-stream")

    async def events(self, behaviour: str, prompt: str):
        events = completion_events(prompt)
        yield events[0]
        if behaviour == "stall-mid-stream":
            await asyncio.sleep(3600)
        if behaviour == "error-event":
            yield sse({"error": {"message": "engine died", "type": "server_error", "param": None, "code": None}})
            return
        if behaviour == "no-done":
            return
        for event in events[1:]:
            yield event


@pytest.fixture(scope="module")
def fake_server():
    fake = FakeOpenAI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def bench(url: str, **overrides) -> object:
    config = BenchConfig(base_url=url, workload="random", input_len=8, output_len=TOKENS_PER_ANSWER,
                         show_progress=False, scrape_metrics=False, **overrides)
    return run_benchmark(config)


@pytest.mark.parametrize("behaviour, kind", [
    ("http500", "http_500"), ("garbage", "malformed_stream"), ("error-event", "stream_error"),
    ("no-done", "malformed_stream"),
])
def test_server_errors_are_reported_by_kind(fake_server, behaviour, kind):
    _, url = fake_server
    result = bench(url, model=behaviour, num_requests=6, max_concurrency=3)
    assert result.summary.num_sent == 6 and result.summary.num_completed == 0
    assert result.summary.errors_by_kind == {kind: 6}
    assert result.summary.ttft is None and result.summary.request_throughput == 0


@pytest.mark.parametrize("behaviour", ["stall", "stall-mid-stream"])
def test_a_stalled_server_times_out_and_the_run_ends(fake_server, behaviour):
    _, url = fake_server
    started = time.perf_counter()
    result = bench(url, model=behaviour, num_requests=4, max_concurrency=4, timeout_s=0.5)
    assert result.summary.errors_by_kind == {"timeout": 4}
    assert time.perf_counter() - started < 10
    if behaviour == "stall-mid-stream":  # what arrived before the stall is kept
        assert all(len(r.chunk_times_s) == 1 for r in result.records)


def test_a_server_that_is_down_at_the_start_is_one_line_on_stderr(capsys):
    from kvserve.cli import main

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed_port = sock.getsockname()[1]
    sock.close()
    assert main(["bench", "--base-url", f"http://127.0.0.1:{closed_port}", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("kvserve bench: error: cannot reach") and error.count("\n") == 1


def test_closed_loop_keeps_the_requested_concurrency_and_count(fake_server):
    fake, url = fake_server
    result = bench(url, model="ok", num_requests=20, max_concurrency=4)
    assert result.summary.num_completed == 20 and result.summary.errors_by_kind == {}
    assert result.summary.completion_tokens == 20 * TOKENS_PER_ANSWER
    assert result.summary.tpot is not None and result.summary.itl.count == 20 * (TOKENS_PER_ANSWER - 1)


def test_duration_ends_an_open_loop_run(fake_server):
    _, url = fake_server
    started = time.perf_counter()
    result = bench(url, model="ok", num_requests=None, duration_s=1.0, request_rate=50)
    assert 1.0 <= time.perf_counter() - started < 5
    assert 30 <= result.summary.num_sent <= 75
    assert max(r.start_s for r in result.records) < 1.0


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_open_loop_arrivals_follow_the_requested_rate(fake_server, burstiness):
    """500 arrivals, timed where the server receives them, at the requested rate within 10% (Poisson, and a
    burstier gamma process). The intervals' spread is checked on the generator itself (test_bench_units):
    at a few milliseconds apart, the event loops' jitter on this machine would swamp it here."""
    fake, url = fake_server
    rate = 200.0
    result = bench(url, model="ok", num_requests=500, request_rate=rate, burstiness=burstiness, seed=1)
    assert result.summary.num_completed == 500
    arrivals = np.array(fake.arrivals[-500:])
    measured_rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert measured_rate == pytest.approx(rate, rel=0.10)
