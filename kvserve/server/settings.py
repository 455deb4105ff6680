"""What the HTTP layer is configured with (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
API_KEY_ENV = "KVSERVE_API_KEY"  # --api-key's default


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str]  # the first is the metrics label and the default for requests without `model`
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    use_generation_config: bool = True  # --generation-config auto: the model's sampling defaults apply
    log_stats_interval_s: float | None = 5.0  # None: no periodic stats line
    owned_by: str = "kvserve"
    root: str | None = None  # the model path, for /v1/models
    log_requests_file: str | None = None  # --log-requests-file: one JSON line per request

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
