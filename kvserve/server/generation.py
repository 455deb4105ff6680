"""What completions and chat share: submit prompts to the engine, merge their output streams, abort on disconnect,
and turn engine-side failures into HTTP errors.

One API request may be several engine requests (a list of prompts); each has its own stream. They are submitted
together and every one is closed (aborting it if unfinished) when the HTTP request ends for any reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request

from kvserve.engine.async_engine import (
    DrainingError, EngineDeadError, EngineError, EngineStoppedError, QueueFullError, RequestCancelled, RequestStream,
)
from kvserve.engine.llm_engine import RequestRejected
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.context import ServerContext
from kvserve.server.errors import SERVER_ERROR, APIError
from kvserve.server.prompts import Prompt
from kvserve.server.sse import DONE, error_event

RETRY_AFTER_S = "1"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it
logger = logging.getLogger("kvserve.server")


class ClientGone(Exception):
    """The client disconnected; there is nobody to answer."""


@dataclass(slots=True)
class EngineJob:
    """The engine requests behind one API request."""

    prompts: list[Prompt]
    params: list[SamplingParams]  # per prompt: max_tokens may differ (the room each prompt leaves)
    streams: list[RequestStream]
    # Per prompt, the last output seen, for the request log (which is written when the job closes).
    latest_outputs: list[RequestOutput | None] = field(default_factory=list)
    on_closed: Callable[[], None] | None = None  # runs once, on the first close

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
        if self.on_closed is not None:
            on_closed, self.on_closed = self.on_closed, None
            on_closed()


def session_of(request, body) -> str | None:
    """The session a request belongs to, for the idle-session policy: the gateway's X-Session-ID header, else
    OpenAI's `user`."""
    return request.headers.get("x-session-id") or getattr(body, "user", None) or None


async def submit(ctx: ServerContext, prompts: list[Prompt], params: list[SamplingParams], cache_salt: str | None,
                 id_prefix: str, session_id: str | None = None) -> EngineJob:
    """Queues every prompt and waits until the engine has accepted them all; on any refusal, none stay queued."""
    job = EngineJob(prompts, params, [], [None] * len(prompts))
    try:
        for prompt, prompt_params in zip(prompts, params):
            request_id = ctx.engine.new_request_id(id_prefix)
            job.streams.append(ctx.engine.submit(request_id, prompt.token_ids, prompt_params, cache_salt, session_id))
        for stream in job.streams:
            await stream.accepted()
    except Exception as exc:
        job.close()
        _count_rejection(ctx, exc)
        raise to_api_error(ctx, exc) from None
    except BaseException:  # cancelled while waiting for the engine: nothing may stay queued
        job.close()
        raise
    return job


def _count_rejection(ctx: ServerContext, exc: Exception) -> None:
    reasons = {QueueFullError: "queue_full", DrainingError: "shutting_down", EngineDeadError: "engine_dead"}
    reason = next((r for kind, r in reasons.items() if isinstance(exc, kind)), None)
    if reason is not None:
        ctx.request_metrics.count_rejected(reason)


def to_api_error(ctx: ServerContext, exc: Exception) -> Exception:
    """Engine-side exceptions -> APIError (or ClientGone); anything else is re-raised as is."""
    if isinstance(exc, APIError | ClientGone):
        return exc
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, DrainingError | EngineStoppedError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="server_shutting_down",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="engine_dead")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type=SERVER_ERROR, code="engine_error")
    if isinstance(exc, RequestCancelled):
        return ClientGone(str(exc))
    return exc


async def merged_outputs(job: EngineJob) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream of the job, as they arrive; raises the first stream error."""
    latest = job.latest_outputs
    if len(job.streams) == 1:
        async for output in job.streams[0]:
            latest[0] = output
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        queue.put_nowait((index, None, StopAsyncIteration()))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(job.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if isinstance(error, StopAsyncIteration):
                remaining -= 1
            elif error is not None:
                raise error
            else:
                latest[index] = output
                yield index, output
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(ctx: ServerContext, job: EngineJob) -> list[RequestOutput]:
    """Waits for every prompt's finished output (non-streaming requests)."""
    finals: list[RequestOutput | None] = [None] * len(job.streams)
    try:
        async for index, output in merged_outputs(job):
            if output.finished:
                finals[index] = output
    except Exception as exc:
        raise to_api_error(ctx, exc) from None
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, job: EngineJob) -> AsyncIterator[None]:
    """Closes (aborts) the job's streams as soon as the client disconnects, and in any case on exit."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.close()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        job.close()


async def finished_outputs(request: Request, ctx: ServerContext, job: EngineJob) -> list[RequestOutput] | None:
    """What every non-streaming route shares: each prompt's finished output, its metrics recorded; None when the
    client disconnected first (the job is then aborted)."""
    try:
        async with abort_on_disconnect(request, job):
            finals = await final_outputs(ctx, job)
    except ClientGone:
        return None
    for index, final in enumerate(finals):
        observe_finished(ctx, job, index, final)
    return finals


def observe_finished(ctx: ServerContext, job: EngineJob, index: int, output: RequestOutput) -> None:
    if output.finished and not any(o.finish_reason == "abort" for o in output.outputs):
        ctx.request_metrics.observe_finished(job.streams[index], output, job.params[index].max_tokens or 0)


def stream_error(ctx: ServerContext, exc: Exception) -> APIError | None:
    """The error event to send when a stream fails midway; None when the client is gone."""
    error = to_api_error(ctx, exc)
    if isinstance(error, ClientGone):
        return None
    if not isinstance(error, APIError):
        logger.error("stream failed", exc_info=exc)
        error = APIError(500, f"internal server error: {type(exc).__name__}", type=SERVER_ERROR)
    return error


def usage_options(options) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) from a request's stream_options."""
    include_usage = bool(options and options.include_usage)
    return include_usage, include_usage and bool(options and options.continuous_usage_stats)


async def guarded_events(request: Request, ctx: ServerContext, job: EngineJob,
                         events: AsyncIterator[str]) -> AsyncIterator[str]:
    """What every SSE route shares: abort on disconnect, an error event instead of a broken stream, [DONE]."""
    async with abort_on_disconnect(request, job):
        try:
            async for item in events:
                yield item
        except Exception as exc:
            error = stream_error(ctx, exc)
            if error is None:
                return
            yield error_event(error)
        yield DONE
