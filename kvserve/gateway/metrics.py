"""The gateway's `/metrics`: one registry per app (two gateways in one process, as in tests, never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvserve.gateway.backends import Backend
from kvserve.gateway.breaker import STATE_VALUES

# Outcomes of a client request as the gateway answered it.
SUCCESS, CLIENT_ERROR, BACKEND_ERROR, UNAVAILABLE, CLIENT_GONE = (
    "success", "client_error", "backend_error", "unavailable", "client_disconnected")
# Upstream latency buckets: time to the backend's response headers (a stream's are sent with its first chunk).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, backends: list[Backend]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve:gateway_requests", "Requests by the backend that answered and outcome",
                                ["backend", "outcome"], registry=self.registry)
        self.routing = Counter("kvserve:gateway_routing_decisions", "Routing decisions by reason",
                               ["reason"], registry=self.registry)
        self.retries = Counter("kvserve:gateway_retries", "Upstream attempts retried, by the backend that failed",
                               ["backend"], registry=self.registry)
        self.rejected = Counter("kvserve:gateway_rejected", "Requests refused by the gateway itself, by reason",
                                ["reason"], registry=self.registry)
        self.prefix_expiries = Counter("kvserve:gateway_prefix_index_expiries",
                                       "Times a backend's prefix-index entries were expired, by what showed its "
                                       "cache lost them (missed: a prefix-routed request did not hit; evictions: "
                                       "its whole pool turned over; restart: its counters started again)",
                                       ["backend", "reason"], registry=self.registry)
        self.upstream_latency = Histogram("kvserve:gateway_upstream_latency_seconds",
                                          "Time from sending to a backend to its response headers",
                                          ["backend"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_BackendCollector(backends))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BackendCollector:
    """Breaker state, health and the backends' own prefix-cache hit rate, read when scraped."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    def describe(self):
        return []

    def collect(self):
        breaker = GaugeMetricFamily("kvserve:gateway_breaker_state", "0 closed, 1 half-open, 2 open",
                                    labels=["backend"])
        healthy = GaugeMetricFamily("kvserve:gateway_backend_healthy", "1 when the last health check passed",
                                    labels=["backend"])
        hit_rate = GaugeMetricFamily("kvserve:gateway_backend_prefix_cache_hit_rate",
                                     "The backend's prefix-cache hits / queries since it started, from its /metrics",
                                     labels=["backend"])
        for backend in self.backends:
            breaker.add_metric([backend.shown_url], STATE_VALUES[backend.breaker.state])
            healthy.add_metric([backend.shown_url], 1.0 if backend.healthy else 0.0)
            queries = backend.load.prefix_cache_queries
            hit_rate.add_metric([backend.shown_url], backend.load.prefix_cache_hits / queries if queries else 0.0)
        yield from (breaker, healthy, hit_rate)
