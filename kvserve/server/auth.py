"""--api-key: `Authorization: Bearer <key>` on /v1 routes; /health, /metrics and /version stay open (as in vLLM),
so probes and Prometheus need no secret.

A pure ASGI middleware rather than FastAPI's `@app.middleware("http")`: that one wraps the response stream, which
interferes with streaming and with client-disconnect detection.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError

PROTECTED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not hmac.compare_digest(_authorization(scope), self.expected):  # constant time: no key-guessing oracle
            error = APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def _authorization(scope: Scope) -> bytes:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return value
    return b""
