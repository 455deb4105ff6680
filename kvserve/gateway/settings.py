"""Everything `kvserve gateway` is configured with, in one place (the CLI fills it, tests build it directly)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvserve.gateway.prefix import DEFAULT_BLOCK_CHARS
from kvserve.gateway.proxy import RetryPolicy
from kvserve.gateway.routing import RoutingConfig
from kvserve.gateway.store import StoreLimits
from kvserve.server.settings import DEFAULT_MAX_REQUEST_BYTES

DEFAULT_STATE_PATH = os.path.join(os.path.expanduser("~"), ".local", "state", "kvserve", "gateway.sqlite3")


@dataclass(slots=True)
class GatewaySettings:
    backends: list[str]  # normalized root URLs
    redis_url: str | None = None
    redis_cluster: str = "auto"  # redis_client.CLUSTER_MODES: whether redis_url names a Redis Cluster node
    state_path: str = DEFAULT_STATE_PATH
    require_api_key: bool = True
    backend_api_key: str | None = None  # for engines started with --api-key (backend_auth: not where a URL has its own)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    store_limits: StoreLimits = field(default_factory=StoreLimits)
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    breaker_failures: int = 5
    breaker_open_s: float = 30.0
    prefix_block_chars: int = DEFAULT_BLOCK_CHARS
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0  # between bytes of a backend's answer, as a long prefill may take
    cache_sharing: str = "key"  # cache_scope: each key its own prefix cache, or "global"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a bigger body is a 413 before it is read
