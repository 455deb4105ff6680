"""The load tester against servers that misbehave, and its open-loop arrivals, on small HTTP apps these tests
start themselves (no model, so only the load tester's behaviour is measured). Nothing here times the machine:
open-loop runs are checked on the schedule the arrival process planned, which a loaded machine cannot move."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.bench.arrivals import arrival_intervals
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
    """/v1/completions whose behaviour is chosen by the request's `model`; counts the streamed requests it
    received per model (the calibration probes are not streamed)."""

    def __init__(self) -> None:
        self.streamed_requests: Counter[str] = Counter()
        self.app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        behaviour, prompt = body["model"], body.get("prompt", "")
        if body.get("stream"):
            self.streamed_requests[behaviour] += 1
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


@pytest.mark.parametrize("behaviour, kind, message", [
    ("http500", "http_500", "boom"), ("garbage", "malformed_stream", "this is not a stream"),
    ("error-event", "stream_error", "engine died"), ("no-done", "malformed_stream", "without data: [DONE]"),
])
def test_server_errors_are_reported_by_kind(fake_server, behaviour, kind, message):
    _, url = fake_server
    result = bench(url, model=behaviour, num_requests=6, max_concurrency=3)
    assert result.summary.num_sent == 6 and result.summary.num_completed == 0
    assert result.summary.errors_by_kind == {kind: 6}
    assert message in result.summary.first_error_by_kind[kind]
    assert result.summary.ttft is None and result.summary.request_throughput == 0


def test_the_console_shows_each_error_kinds_first_message(fake_server, capsys):
    from kvserve.cli import main

    _, url = fake_server
    argv = ["bench", "--base-url", url, "--model", "http500", "--workload", "random", "--input-len", "8",
            "--output-len", "3", "--num-requests", "4", "--max-concurrency", "2", "--no-metrics", "--no-progress"]
    assert main(argv) == 1  # nothing completed
    shown = capsys.readouterr().out
    assert "errors: http_500" in shown  # the count, as before
    row = next(line for line in shown.splitlines() if "http_500" in line and "boom" in line)
    assert " 4 " in row  # the body's error.message beside its kind and count


@pytest.mark.parametrize("behaviour", ["stall", "stall-mid-stream"])
def test_a_stalled_server_times_out_and_the_run_ends(fake_server, behaviour):
    _, url = fake_server
    result = bench(url, model=behaviour, num_requests=4, max_concurrency=4, timeout_s=0.5)
    # The server stalls for an hour: that the run returned at all is the timeout working, and each request
    # says the limit it was given.
    assert result.summary.errors_by_kind == {"timeout": 4}
    assert all(r.error_message == "no complete answer within 0.5 s" for r in result.records)
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
    assert all(r.scheduled_s is None for r in result.records)  # no arrival process in a closed loop


def planned_schedule(records, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """The records' scheduled send times, in session order, after checking they are the arrival process's
    own: consecutive sessions one generated interval apart, from the first arrival on."""
    records = sorted(records, key=lambda r: r.session_index)
    assert [r.session_index for r in records] == list(range(len(records)))
    scheduled = np.array([r.scheduled_s for r in records], dtype=float)
    intervals = np.fromiter(itertools.islice(arrival_intervals(rate, burstiness, seed), len(records) - 1), float)
    # Only float64 rounding of absolute clock readings separates the two (nanoseconds, not the intervals' ms).
    assert np.diff(scheduled) == pytest.approx(intervals, abs=1e-6)
    assert all(r.start_s >= r.scheduled_s for r in records)  # never sent before its time
    return scheduled


def test_duration_ends_an_open_loop_run(fake_server):
    """With no --num-requests only --duration ends the run: it sends the arrival schedule's first arrivals, in
    order, none scheduled after the duration (an arrival due later is never sent), and lasts at least the
    duration."""
    _, url = fake_server
    rate, duration_s = 50.0, 1.0
    result = bench(url, model="ok", num_requests=None, duration_s=duration_s, request_rate=rate)
    scheduled = planned_schedule(result.records, rate, burstiness=1.0, seed=0)
    assert len(scheduled) > 0
    assert scheduled.max() < duration_s
    assert result.summary.duration_s >= duration_s


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_open_loop_arrivals_follow_the_requested_rate(fake_server, burstiness):
    """500 requests at 200/s (Poisson, and a burstier gamma process): the run's planned send times are the
    arrival process's, at the requested rate within 10%, and every request reached the server. The intervals'
    spread is checked on the generator itself (test_bench_units)."""
    fake, url = fake_server
    rate, num_requests = 200.0, 500
    received_before = fake.streamed_requests["ok"]
    result = bench(url, model="ok", num_requests=num_requests, request_rate=rate, burstiness=burstiness, seed=1)
    assert result.summary.num_completed == num_requests and result.summary.errors_by_kind == {}
    assert fake.streamed_requests["ok"] - received_before == num_requests
    scheduled = planned_schedule(result.records, rate, burstiness, seed=1)
    planned_rate = (num_requests - 1) / (scheduled[-1] - scheduled[0])
    assert planned_rate == pytest.approx(rate, rel=0.10)
