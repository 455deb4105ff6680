"""What the gateway knows of each backend: its URL, whether it answers, its breaker, and its load as its own
`/metrics` reports it (vLLM's names, so a vLLM engine is a backend as much as a kvserve one).

This is observed state, re-read from the backends every health interval, so keeping it per process is right:
each replica sees the same backends. Routing state (sessions, prefixes) lives in the store.
"""

from __future__ import annotations

from collections import deque
from dataclasses import InitVar, dataclass, field
from urllib.parse import urlsplit

from kvserve.gateway.backend_auth import backend_credentials
from kvserve.gateway.breaker import CircuitBreaker
from kvserve.gateway.urls import redacted_url


EVICTION_MARKS = 120  # ten minutes of health checks at the default 5 s


class BadBackendURL(ValueError):
    pass


@dataclass(slots=True)
class BackendLoad:
    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_cache_usage: float = 0.0  # 0..1, vllm:kv_cache_usage_perc
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    evictions: float = 0.0  # kvserve:prefix_cache_evictions_total (kvserve only; 0 from vLLM)
    capacity_blocks: float = 0.0  # kvserve:kv_cache_capacity_blocks


@dataclass(slots=True)
class Backend:
    # Given as configured; kept without its credentials (backend_auth), which is where requests go and the
    # backend's identity in the store: a password in a --backend URL is sent, never stored in Redis or SQLite.
    url: str
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    api_key: InitVar[str | None] = None  # --backend-api-key
    healthy: bool = True
    load: BackendLoad = field(default_factory=BackendLoad)
    in_flight: int = 0  # requests this gateway has open on it: fresher than the last /metrics scrape
    # (time, evictions so far) at each /metrics read, to find since when the backend evicted a whole pool.
    eviction_marks: deque = field(default_factory=lambda: deque(maxlen=EVICTION_MARKS))
    cache_horizon: float = 0.0  # the latest horizon reported for it (entries at or before it are gone)
    shown_url: str = field(init=False)  # the URL with its password masked: what logs, metrics and answers show
    headers: dict[str, str] = field(init=False)  # what authenticates every request to it

    def __post_init__(self, api_key: str | None) -> None:
        self.shown_url = redacted_url(self.url)
        self.url, self.headers = backend_credentials(self.url, api_key)

    def available(self) -> bool:
        return self.healthy and self.breaker.allows_request()

    def saturation(self, max_waiting: float, max_kv_usage: float) -> float:
        """llm-d's saturation: >= 1 means the backend should take no new work it can avoid."""
        waiting = max(self.load.num_waiting, self.in_flight - self.load.num_running)
        return max(waiting / max_waiting, self.load.kv_cache_usage / max_kv_usage)

    def queue_length(self) -> float:
        """Requests on the backend: this gateway's own in flight, or its /metrics running + waiting if more."""
        return max(float(self.in_flight), self.load.num_running + self.load.num_waiting)

    def load_score(self) -> tuple[float, float, float]:
        # Queue first (what a new request waits behind), then KV usage (how soon it would preempt), then running.
        waiting = max(self.load.num_waiting, self.in_flight - self.load.num_running)
        return (waiting, self.load.kv_cache_usage, max(self.load.num_running, self.in_flight))


def normalize_backend_url(url: str) -> str:
    """http(s)://host[:port][/v1] -> http(s)://host[:port]; anything else is a BadBackendURL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadBackendURL(f"--backend {redacted_url(url)!r} is not an http(s)://host[:port] URL")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise BadBackendURL(f"--backend {redacted_url(url)!r} has an invalid port") from None
    path = parts.path.rstrip("/")
    if path not in ("", "/v1"):
        raise BadBackendURL(f"--backend {redacted_url(url)!r}: give the server's root (or /v1), not {parts.path!r}")
    return f"{parts.scheme}://{parts.netloc}"
