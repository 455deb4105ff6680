"""--api-key: `Authorization: Bearer <key>` on /v1 routes; /health, /metrics and /version stay open (as in vLLM),
so probes and Prometheus need no secret. The scheme is matched in any case (`bearer`, `BEARER`), as HTTP's
auth schemes are case-insensitive (RFC 7235 section 2.1), with the whitespace HTTP allows around the value and
between the scheme and the key.

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
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not self._authorized(_authorization(scope)):
            error = APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        token = bearer_token(header)
        # Constant time over the key: no key-guessing oracle (the scheme is no secret).
        return token is not None and hmac.compare_digest(token, self.expected_key)


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of `Bearer <token>`, the scheme in any case and surrounding whitespace ignored; None for
    another scheme or no credentials."""
    parts = header.split(None, 1)  # the scheme, then everything after the whitespace that ends it
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip(b" \t")


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def _authorization(scope: Scope) -> bytes:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return value
    return b""
