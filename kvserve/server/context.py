"""Everything a route needs, built once per app and kept on `app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from prometheus_client import CollectorRegistry

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.errors import APIError
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import RequestMetrics
from kvserve.server.request_log import RequestLog
from kvserve.server.settings import ServerSettings


@dataclass(slots=True)
class ServerContext:
    engine: AsyncLLMEngine
    settings: ServerSettings
    registry: CollectorRegistry
    request_metrics: RequestMetrics
    sampling_defaults: dict[str, float | int]
    token_texts: TokenTexts
    created: int  # unix time the server started, for /v1/models
    request_log: RequestLog | None = None  # --log-requests-file, open while the app runs

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.loaded.config.vocab_size

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve (vLLM's check)."""
        if requested is None:
            return self.settings.model_name
        if requested not in self.settings.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx
