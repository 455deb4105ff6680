"""Work on a client's behalf that stops when the client leaves. ASGI servers do not cancel a handler whose
client disconnected, so a gateway waiting on a backend's whole answer would keep the backend generating for
nobody; cancelling the wait closes the upstream connection, which the backend takes as an abort."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientLeft(Exception):
    pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientLeft once it is cancelled because the client disconnected first. Call it once
    the body has been read: from then on the only message the client's side can send is its disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled (a shutdown): nothing is left running
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup closes the upstream
    if task.cancelled():
        raise ClientLeft
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
