"""One streaming request to an OpenAI-compatible server, measured; every failure becomes an error kind.

Nothing here raises for what a server does (error statuses, stalls, dropped connections, garbage): the record
says what happened, so one bad answer never ends a run of a thousand.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvserve.bench.records import (
    CLIENT_ERROR, CONNECTION, MALFORMED_STREAM, STREAM_ERROR, TIMEOUT, RequestRecord,
)
from kvserve.bench.sse import DONE, MalformedStream, ServerStreamError, StreamReader, parse_event_line

COMPLETIONS = "completions"
CHAT = "chat"
ENDPOINT_PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


@dataclass(slots=True)
class Target:
    base_url: str  # scheme://host:port, without /v1
    model: str
    endpoint: str  # COMPLETIONS or CHAT
    api_key: str | None = None
    temperature: float | None = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # merged into every request (e.g. llama-server's cache_prompt)

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_base_url(url: str) -> str:
    """Accepts http://host:port, http://host:port/ and http://host:port/v1 alike."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_body(target: Target, prompt_or_messages: str | list[dict], max_tokens: int) -> dict:
    body: dict = {"model": target.model, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    body["messages" if target.endpoint == CHAT else "prompt"] = prompt_or_messages
    if target.temperature is not None:
        body["temperature"] = target.temperature
    if target.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension that kvserve and llama-server accept; OpenAI itself does not
    body.update(target.extra_body)
    return body


async def send_request(http: httpx.AsyncClient, target: Target, record: RequestRecord,
                       prompt_or_messages: str | list[dict], timeout_s: float) -> RequestRecord:
    """Fills `record` in place (so a timeout keeps what had arrived) and returns it."""
    body = request_body(target, prompt_or_messages, record.max_tokens)
    try:
        await asyncio.wait_for(_stream(http, target, body, record), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.fail(TIMEOUT, f"no complete answer within {timeout_s:g} s")
    except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError) as exc:
        record.fail(CONNECTION, f"{type(exc).__name__}: {exc}")
    except MalformedStream as exc:
        record.fail(MALFORMED_STREAM, str(exc))
    except ServerStreamError as exc:
        record.fail(STREAM_ERROR, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported per request; the run goes on
        record.fail(CLIENT_ERROR, f"{type(exc).__name__}: {exc}")
    return record


async def _stream(http: httpx.AsyncClient, target: Target, body: dict, record: RequestRecord) -> None:
    sent_at = time.perf_counter()
    reader = StreamReader(record, sent_at)
    async with http.stream("POST", target.url, json=body, headers=target.headers()) as response:
        if response.status_code != 200:
            await response.aread()
            record.fail(f"http_{response.status_code}", error_message(response))
            return
        async for line in response.aiter_lines():
            event = parse_event_line(line)
            if event is DONE:
                reader.finish(time.perf_counter())
                return
            if event is not None:
                reader.add(event, time.perf_counter())
    raise MalformedStream("the stream ended without data: [DONE]")


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI error envelope (or of vLLM's older flat one, {"object": "error", "message"}),
    else the start of the body."""
    try:
        body = response.json()
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("message"), str) and body["message"]:
            return body["message"]
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        pass
    return response.text[:200] or response.reason_phrase


def make_http_client(timeout_s: float) -> httpx.AsyncClient:
    # No connection cap: --max-concurrency is the only limit on requests in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)
