"""GET /v1/models, /health, /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from kvserve import __version__
from kvserve.engine.async_engine import EngineState
from kvserve.server.context import ServerContext, get_context
from kvserve.server.errors import SERVER_ERROR, APIError
from kvserve.server.responses import json_response

router = APIRouter()


def model_card(ctx: ServerContext, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": ctx.created,
        "owned_by": ctx.settings.owned_by,
        "root": ctx.settings.root or name,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    ctx = get_context(request)
    return json_response({"object": "list", "data": [model_card(ctx, n) for n in ctx.settings.served_model_names]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    ctx = get_context(request)
    return json_response(model_card(ctx, ctx.resolve_model(model_id)))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 once it is draining for shutdown or dead (readiness probes stop routing)."""
    engine = get_context(request).engine
    if engine.is_alive and engine.state is EngineState.RUNNING:
        return Response(status_code=200)
    reason = "shutting down" if engine.state is EngineState.DRAINING else f"engine {engine.state.value}"
    raise APIError(503, f"unhealthy: {reason}", type=SERVER_ERROR, code="unhealthy")


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(get_context(request).registry), media_type=CONTENT_TYPE_LATEST)
