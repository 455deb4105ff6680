"""Opening a request on a backend, with retries: a connect error, a connection dropped before any response, or a
503 (the engine's queue is full or it is shutting down) moves the request to another backend after a short
backoff, the failed one excluded and its breaker told. Once a backend has sent its response headers the request
is committed to it: nothing is retried after a stream began (its tokens already reached the client)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from kvserve.gateway.backends import Backend
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.request_state import RequestState
from kvserve.gateway.routing import NoBackendAvailable, RouteDecision, Router

# Errors that prove the backend did not start on the request (or never got it), so resending cannot duplicate:
# refused or timed out connecting, the connection dropped or reset before the response's headers (a read
# timeout is not among them: the backend may be prefilling it).
# (aiohttp.ClientOSError includes ClientConnectorError, a refused connection.)
RETRYABLE_ERRORS = (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError)
RETRYABLE_STATUSES = (503,)


class UpstreamFailed(Exception):
    pass


@dataclass(slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_s: float = 0.05  # doubled per attempt

    def delay_s(self, attempt: int) -> float:
        return self.backoff_s * 2 ** (attempt - 1) if attempt else 0.0


@dataclass(slots=True)
class Upstream:
    decision: RouteDecision
    response: aiohttp.ClientResponse  # headers read; the body not yet

    @property
    def backend(self) -> Backend:
        return self.decision.backend

    async def close(self) -> None:
        # Closing a partly read response drops its connection: the backend sees its client leave and aborts. A
        # body read to its end has already given its connection back to the pool, which this leaves open.
        self.response.close()
        self.backend.in_flight -= 1


async def open_upstream(http: aiohttp.ClientSession, router: Router, metrics: GatewayMetrics, policy: RetryPolicy,
                        path: str, content: bytes, headers: dict[str, str], session_id: str | None,
                        block_hashes: list[str], known: RequestState | None = None) -> Upstream:
    """`known`: the request's state as read before routing, good for the first attempt only."""
    tried: set[str] = set()
    last_failure = "no attempt made"
    for attempt in range(policy.max_attempts):
        await asyncio.sleep(policy.delay_s(attempt))
        try:
            decision = await router.route(session_id, block_hashes, tried, known if attempt == 0 else None)
        except NoBackendAvailable as exc:
            raise UpstreamFailed(f"{exc}; last failure: {last_failure}" if tried else str(exc)) from None
        metrics.routing.labels(decision.reason).inc()
        upstream = await _attempt(http, decision, metrics, path, content, headers)
        if isinstance(upstream, Upstream):
            router.record(decision, block_hashes)
            return upstream
        last_failure = upstream
        tried.add(decision.backend.url)
        metrics.retries.labels(decision.backend.shown_url).inc()
    raise UpstreamFailed(f"{policy.max_attempts} attempts failed; last: {last_failure}")


async def _attempt(http: aiohttp.ClientSession, decision: RouteDecision, metrics: GatewayMetrics, path: str,
                   content: bytes, headers: dict[str, str]) -> Upstream | str:
    """An open Upstream, or why this backend failed."""
    backend = decision.backend
    backend.breaker.on_attempt()
    backend.in_flight += 1
    started = time.perf_counter()
    try:
        response = await http.post(backend.url + path, data=content, headers={**headers, **backend.headers})
    except RETRYABLE_ERRORS as exc:
        backend.in_flight -= 1
        backend.breaker.on_failure()
        return f"{backend.shown_url}: {type(exc).__name__}"
    except BaseException:
        backend.in_flight -= 1
        raise
    metrics.upstream_latency.labels(backend.shown_url).observe(time.perf_counter() - started)
    if response.status in RETRYABLE_STATUSES:
        response.close()
        backend.in_flight -= 1
        backend.breaker.on_failure()
        return f"{backend.shown_url}: HTTP {response.status}"
    backend.breaker.on_success()
    return Upstream(decision, response)
