"""The FastAPI app: `build_app(async_engine, settings)`; the engine thread starts and stops with the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kvserve import __version__
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server import routes_chat, routes_completions, routes_info
from kvserve.server.auth import ApiKeyMiddleware
from kvserve.server.context import ServerContext
from kvserve.server.errors import install_error_handlers
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import build_metrics
from kvserve.server.request_log import RequestLog, pool_geometry
from kvserve.server.request_log_metrics import RequestLogCollector
from kvserve.server.sampling import model_sampling_defaults
from kvserve.server.settings import ServerSettings
from kvserve.server.stats_logger import log_stats_forever


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    registry, request_metrics = build_metrics(engine, settings.model_name)
    generation_config = engine.engine.loaded.generation_config if settings.use_generation_config else {}
    ctx = ServerContext(
        engine=engine,
        settings=settings,
        registry=registry,
        request_metrics=request_metrics,
        sampling_defaults=model_sampling_defaults(generation_config),
        token_texts=TokenTexts(engine.engine.tokenizer),
        created=int(time.time()),
    )
    registry.register(RequestLogCollector(lambda: ctx.request_log, settings.model_name))
    app = FastAPI(title="kvserve", version=__version__, lifespan=_lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    for module in (routes_completions, routes_chat, routes_info):
        app.include_router(module.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    ctx: ServerContext = app.state.ctx
    if ctx.settings.log_requests_file:
        geometry = pool_geometry(ctx.engine.engine.kv_cache, str(ctx.engine.engine.loaded.path))
        ctx.request_log = RequestLog(ctx.settings.log_requests_file, geometry)
    ctx.engine.start()
    stats_task = None
    if ctx.settings.log_stats_interval_s:
        stats_task = asyncio.create_task(log_stats_forever(ctx.engine, ctx.settings.log_stats_interval_s))
    try:
        yield
    finally:
        try:
            if stats_task is not None:
                stats_task.cancel()
            # uvicorn has already waited (up to --shutdown-timeout) for in-flight HTTP requests; what is left is
            # aborted.
            await ctx.engine.stop(grace_period_s=0.0)
        finally:
            try:
                # Before the engine saves its KV tiers (up to --kv-disk-save-timeout): a pod killed at the end of
                # its grace period, or a save that fails, must not cost the log what was served.
                if ctx.request_log is not None:
                    ctx.request_log.close()  # flushes what is queued
            finally:
                await ctx.engine.close()
