"""Server-sent events exactly as OpenAI sends them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.server.errors import APIError
from kvserve.server.responses import dumps

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx and friends: do not buffer the stream
}


def event(body: dict) -> str:
    return f"data: {dumps(body)}\n\n"


def error_event(error: APIError) -> str:
    # Headers are gone by the time a stream fails, so the error travels as a data event (vLLM does the same).
    return event(error.envelope())


class SSEResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed, cancelled, or the client gone before the
    first event (when the event generator never even starts, so its own cleanup would never run)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
