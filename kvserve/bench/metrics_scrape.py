"""The server's own view of a run, from its Prometheus /metrics: counters before and after, gauges polled.

Names are vLLM's (kvserve exports the same); older vLLM names and llama-server's `llamacpp:` names are read
as fallbacks where they mean the same thing. A server without /metrics, or without these series, gives None
for each figure it lacks: the run is still reported from the client's side.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPT_TOKENS = ("vllm:prompt_tokens_total", "llamacpp:prompt_tokens_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREEMPTIONS = ("vllm:num_preemptions_total",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio")
RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
# kvserve's KV tiers, per `tier` label (host, disk): blocks loaded back into the pool, bytes each way.
TIER_HITS = "kvserve:kv_tier_hits_total"
TIER_BYTES = "kvserve:kv_tier_bytes_total"


@dataclass(slots=True)
class MetricsSnapshot:
    samples: dict[str, float]  # sample name -> value summed over its label sets (models, engines)
    # KV tier samples by (name, tier, direction or ""), summed over the other labels.
    tiers: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def first(self, names: tuple[str, ...]) -> float | None:
        return next((self.samples[n] for n in names if n in self.samples), None)


def parse_metrics(text: str) -> MetricsSnapshot:
    samples: dict[str, float] = {}
    tiers: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
            if "tier" in sample.labels:
                key = (sample.name, sample.labels["tier"], sample.labels.get("direction", ""))
                tiers[key] = tiers.get(key, 0.0) + sample.value
    return MetricsSnapshot(samples, tiers)


async def scrape(http: httpx.AsyncClient, base_url: str) -> MetricsSnapshot | None:
    """None when the server has no usable /metrics."""
    try:
        response = await http.get(f"{base_url}/metrics", timeout=10.0)
        if response.status_code != 200:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


@dataclass(slots=True)
class GaugeSample:
    t_s: float  # since the run started
    kv_usage: float | None  # 0..1
    num_running: float | None
    num_waiting: float | None


def gauge_sample(snapshot: MetricsSnapshot, t_s: float) -> GaugeSample:
    return GaugeSample(t_s, snapshot.first(KV_USAGE), snapshot.first(RUNNING), snapshot.first(WAITING))


@dataclass(slots=True)
class GaugePoller:
    """Samples KV usage and queue lengths every `interval_s` while the run goes on (peaks between two scrapes
    are missed; a shorter interval costs the server a little CPU per scrape)."""

    http: httpx.AsyncClient
    base_url: str
    started_at: float  # perf_counter of the run's start
    interval_s: float = 0.5
    samples: list[GaugeSample] = field(default_factory=list)

    async def poll_forever(self) -> None:
        while True:
            snapshot = await scrape(self.http, self.base_url)
            if snapshot is not None:
                self.samples.append(gauge_sample(snapshot, time.perf_counter() - self.started_at))
            await asyncio.sleep(self.interval_s)


@dataclass(slots=True)
class ServerView:
    prompt_tokens: float | None = None  # counter deltas over the run
    generation_tokens: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None  # hits / queries over the run
    preemptions: float | None = None
    peak_kv_usage: float | None = None  # 0..1
    peak_running: float | None = None
    peak_waiting: float | None = None
    gauges: list[GaugeSample] = field(default_factory=list)
    # Per KV tier (kvserve's --kv-offloading-size / --kv-disk-path), over the run: blocks loaded back into the
    # pool, bytes loaded (out of the tier) and offloaded (into it). Empty when the server has no tiers.
    tier_hits: dict[str, float] = field(default_factory=dict)
    tier_bytes_loaded: dict[str, float] = field(default_factory=dict)
    tier_bytes_offloaded: dict[str, float] = field(default_factory=dict)


def delta(before: MetricsSnapshot, after: MetricsSnapshot, names: tuple[str, ...]) -> float | None:
    first, last = before.first(names), after.first(names)
    return None if first is None or last is None else last - first


def tier_deltas(before: MetricsSnapshot, after: MetricsSnapshot, name: str, direction: str) -> dict[str, float]:
    return {tier: value - before.tiers.get((sample, tier, way), 0.0)
            for (sample, tier, way), value in after.tiers.items() if sample == name and way == direction}


def peak(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def server_view(before: MetricsSnapshot | None, after: MetricsSnapshot | None, gauges: list[GaugeSample],
                elapsed_s: float) -> ServerView | None:
    """`gauges` polled during the run; the before/after snapshots add the first and last points."""
    if before is None or after is None:
        return None
    gauges = [gauge_sample(before, 0.0), *gauges, gauge_sample(after, elapsed_s)]
    view = ServerView(
        prompt_tokens=delta(before, after, PROMPT_TOKENS),
        generation_tokens=delta(before, after, GENERATION_TOKENS),
        prefix_cache_queries=delta(before, after, PREFIX_QUERIES),
        prefix_cache_hits=delta(before, after, PREFIX_HITS),
        preemptions=delta(before, after, PREEMPTIONS),
        gauges=gauges,
    )
    if view.prefix_cache_queries and view.prefix_cache_hits is not None:
        view.prefix_cache_hit_rate = view.prefix_cache_hits / view.prefix_cache_queries
    view.tier_hits = tier_deltas(before, after, TIER_HITS, "")
    view.tier_bytes_loaded = tier_deltas(before, after, TIER_BYTES, "out")
    view.tier_bytes_offloaded = tier_deltas(before, after, TIER_BYTES, "in")
    view.peak_kv_usage = peak([g.kv_usage for g in gauges])
    view.peak_running = peak([g.num_running for g in gauges])
    view.peak_waiting = peak([g.num_waiting for g in gauges])
    return view
