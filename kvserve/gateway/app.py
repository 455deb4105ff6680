"""The gateway's FastAPI app: OpenAI's routes proxied to the backends, plus `/health`, `/metrics` and
`GET /v1/conversations/{id}` (a stored conversation's messages). Errors use OpenAI's envelope, the server's own
handlers; a store that fails (Redis down) is a 503 with code `store_unavailable`, never a hung request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvserve.gateway.backends import Backend
from kvserve.gateway.breaker import CircuitBreaker
from kvserve.gateway.conversation import stored_id
from kvserve.gateway.forward import Gateway, authenticate, forward_completion
from kvserve.gateway.health import check_all, health_loop
from kvserve.gateway.metrics import GatewayMetrics
from kvserve.gateway.routing import Router
from kvserve.gateway.settings import GatewaySettings
from kvserve.gateway.store import Store, StoreUnavailable, connect_store, drain_background
from kvserve.server.errors import SERVER_ERROR, APIError, install_error_handlers, unexpected_error_response
from kvserve.server.responses import json_response

logger = logging.getLogger("kvserve.gateway")


def make_backends(settings: GatewaySettings) -> list[Backend]:
    return [Backend(url, CircuitBreaker(settings.breaker_failures, settings.breaker_open_s), settings.backend_api_key)
            for url in settings.backends]


# Idle connections are dropped before uvicorn's own 5 s keep-alive (kvserve's and vLLM's servers) closes them: at
# equal timeouts a request (or a health check every 5 s) could be sent on a connection the backend was closing,
# fail with the connection dropped and count against a healthy backend (we saw a stub backend marked down that way).
KEEPALIVE_EXPIRY_S = 4.0


def make_http_client(settings: GatewaySettings) -> aiohttp.ClientSession:
    """The gateway's one client to its backends (aiohttp: its C HTTP parser costs the gateway's event loop much
    less per request than httpx). Its timeouts are a completion's: connecting, then between bytes of the answer;
    a health check passes its own. Called inside the server's event loop."""
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s,
                                    sock_read=settings.upstream_timeout_s)
    # No pool cap: the backends' own queues are the limit, and a capped pool would queue requests unseen.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


Handler = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI, except that POSTs to the completion routes are answered before its stack: between uvicorn and an
    endpoint FastAPI runs its middleware layers (errors, telemetry, body limit, exceptions, exit stack), matches
    the path against every route and solves the endpoint's dependencies, work a proxy would pay on every request
    for nothing (no body limit, no telemetry, an endpoint that takes only the Request). Those routes raise the
    same errors as the rest and get the same answers; every other request, lifespan included, goes to FastAPI."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.completion_routes: dict[str, Handler] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.completion_routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        try:
            response = await handler(Request(scope, receive))
        except APIError as exc:
            response = exc.response()
        except StoreUnavailable as exc:
            response = _store_unavailable(exc)
        except Exception as exc:
            response = unexpected_error_response(scope["method"], scope["path"], exc)
        await response(scope, receive, send)


def _store_unavailable(exc: StoreUnavailable) -> Response:
    logger.warning("store unavailable: %s", exc)
    return APIError(503, f"the gateway's state store is unavailable: {exc}", type=SERVER_ERROR,
                    code="store_unavailable", headers={"Retry-After": "1"}).response()


def build_app(settings: GatewaySettings, store: Store | None = None) -> FastAPI:
    """`store` None: opened from the settings inside the server's event loop (Redis's client is bound to it)."""
    backends = make_backends(settings)
    metrics = GatewayMetrics(backends)
    holder: dict[str, Gateway] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway_store = store or await connect_store(settings.redis_url, settings.state_path, settings.store_limits,
                                                     settings.redis_cluster)
        http = make_http_client(settings)
        router = Router(backends, gateway_store, settings.routing)
        holder["gateway"] = Gateway(settings, gateway_store, backends, router, metrics, http)

        def on_cache_lost(backend: Backend, horizon: float, reason: str) -> None:
            logger.info("backend %s lost its cached prefixes (%s): the prefix index forgets them", backend.shown_url,
                        reason)
            metrics.prefix_expiries.labels(backend.shown_url, reason).inc()
            router.expire_prefixes(backend.url, horizon)

        health_timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s)
        await check_all(http, backends, health_timeout)
        task = asyncio.create_task(health_loop(http, backends, health_timeout, settings.health_interval_s,
                                               on_cache_lost))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await http.close()
            await drain_background()
            await gateway_store.close()

    app = GatewayApp(title="kvserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable_handler(request: Request, exc: StoreUnavailable) -> Response:
        return _store_unavailable(exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward_completion(holder["gateway"], request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward_completion(holder["gateway"], request, "/v1/completions", chat=False)

    # Declared on FastAPI too (its route list, a 405 for another method), but answered by GatewayApp's fast path.
    app.completion_routes = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway = holder["gateway"]
        await authenticate(gateway, request)
        return await _first_answer(gateway, "/v1/models")

    @app.get("/v1/conversations/{conversation_id}")
    async def conversation(conversation_id: str, request: Request) -> Response:
        gateway = holder["gateway"]
        key = await authenticate(gateway, request)
        messages = await gateway.store.conversation_load(stored_id(conversation_id, key.key_id if key else None))
        if not messages:
            raise APIError(404, f"no conversation {conversation_id!r}", code="conversation_not_found")
        return json_response({"id": conversation_id, "object": "conversation", "messages": messages})

    @app.get("/health")
    async def health() -> Response:
        gateway = holder["gateway"]
        await gateway.store.ping()
        up = [b.shown_url for b in gateway.backends if b.available()]
        if not up:
            raise APIError(503, "no backend is healthy", type=SERVER_ERROR, code="no_backend_available")
        return json_response({"status": "ok", "backends_up": up})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _first_answer(gateway: Gateway, path: str) -> Response:
    """A GET every backend answers alike (the models list): the first available backend that answers."""
    for backend in gateway.backends:
        if not backend.available():
            continue
        try:
            async with gateway.http.get(backend.url + path, headers=backend.headers) as response:
                content = await response.read()
        except aiohttp.ClientError:
            continue
        return Response(content, status_code=response.status,
                        media_type=response.headers.get("content-type", "application/json"))
    raise APIError(503, "no backend is available", type=SERVER_ERROR, code="no_backend_available")
