"""Passing a backend's SSE stream through: event by event as it arrives (a backend writes one event per chunk,
so nothing waits on the gateway), read on the way for the conversation's answer and the usage, and closed
upstream however the client's side ends, so a client that goes away aborts its request on the engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

EVENT_END = b"\n\n"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Complete events (each ending with a blank line), whatever the chunking; a tail without one at the end."""
    pending = b""
    async for chunk in chunks:
        pending = (pending + chunk).replace(b"\r\n", b"\n")  # on the joined bytes: a CRLF may straddle chunks
        while (end := pending.find(EVENT_END)) >= 0:
            yield pending[: end + len(EVENT_END)]
            pending = pending[end + len(EVENT_END):]
    if pending:
        yield pending


@dataclass(slots=True)
class StreamTap:
    """What a chat or completion stream said: choice 0's text, the usage, whether [DONE] came."""

    drop_usage_event: bool = False  # the gateway asked for usage; the client did not, so it must not see it
    text_parts: list[str] = field(default_factory=list)
    total_tokens: int = 0
    usage: dict | None = None
    done: bool = False
    text_chunks: int = 0  # choices' text deltas passed on (a backend streams about one token each)

    def read(self, event: bytes) -> bool:
        """Notes what the event carries; False when the event is to be withheld from the client."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if isinstance(chunk, dict):
                return self._read_chunk(chunk)
        return True

    def _read_chunk(self, chunk: dict) -> bool:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            self.total_tokens = int(usage.get("total_tokens") or 0)
        choices = chunk.get("choices") or []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            text = _choice_text(choice)
            self.text_chunks += bool(text)
            if choice.get("index", 0) == 0:
                self.text_parts.append(text)
        return not (self.drop_usage_event and usage and not choices)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


class UpstreamStreamResponse(StreamingResponse):
    """Streams `events` and runs `on_close` however it ends. It watches for the client's disconnect itself (the
    ASGI 2.4 path of StreamingResponse only notices one when a send fails, which for a backend that is
    still prefilling could be seconds later)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()
