"""Prometheus metrics under vLLM's names (so existing dashboards and routers work) plus `kvserve:` pool metrics.

Two sources:
- engine state (gauges and counters) is read at scrape time from the snapshot the engine thread publishes after
  every iteration, so counters are exactly the engine's (they never reset, as Prometheus counters must not);
- per-request histograms are observed by the server when a request finishes, from engine-clock timestamps.

Every series carries `model_name` (the first --served-model-name) and `engine` ("0"), as vLLM's do.
Each app gets its own CollectorRegistry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.cache.tier_stats import LOAD_BUCKETS
from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.engine.outputs import RequestOutput

LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestMetrics:
    """Per-request histograms, observed once per finished request."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = (model_name, "0")
        self._rejected = Counter("kvserve:requests_rejected", "Requests refused before reaching the engine, by reason "
                                 "(queue_full, shutting_down, engine_dead).", LABELS + ["reason"], registry=registry)
        self._labels = labels

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*labels)

        token_buckets = buckets_1_2_5(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                     TOKEN_LATENCY_BUCKETS)
        # The older name of the same per-token observation, still read by many dashboards.
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.", TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           token_buckets)
        self.max_tokens_param = histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", token_buckets)
        self.n_param = histogram("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])

    def count_rejected(self, reason: str) -> None:
        self._rejected.labels(*self._labels, reason).inc()

    def observe_finished(self, stream: RequestStream, final: RequestOutput, max_tokens: int) -> None:
        timing = stream.timing
        num_generated = sum(len(o.token_ids) for o in final.outputs)
        self.prompt_tokens.observe(len(final.prompt_token_ids))
        self.generation_tokens.observe(num_generated)
        self.max_tokens_param.observe(max_tokens)
        self.n_param.observe(len(final.outputs))
        for latency in timing.inter_token_latencies:
            self.inter_token.observe(latency)
            self.time_per_output_token.observe(latency)
        arrival, scheduled, first, finished = (timing.arrival_time, timing.first_scheduled_time,
                                               timing.first_token_time, timing.finished_time)
        if arrival is None or first is None or finished is None:
            return
        self.ttft.observe(first - arrival)
        self.e2e.observe(finished - arrival)
        self.decode.observe(finished - first)
        tokens_after_first = len(final.outputs[0].token_ids) - 1
        if tokens_after_first > 0:
            self.request_time_per_output_token.observe((finished - first) / tokens_after_first)
        if scheduled is not None:
            self.queue.observe(max(0.0, scheduled - arrival))
            self.prefill.observe(max(0.0, first - scheduled))
            self.inference.observe(max(0.0, finished - scheduled))


class EngineCollector(Collector):
    """Gauges and counters read from the engine thread's latest snapshot at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, cache_info: dict[str, str]) -> None:
        self.engine = engine
        self.labels = [model_name, "0"]
        self.cache_info = cache_info
        self.block_bytes = engine.engine.pool.block_bytes
        self.device = engine.engine.device

    def collect(self) -> Iterator[Metric]:
        snapshot = self.engine.snapshot
        stats, census = snapshot.stats, snapshot.census
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          stats.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            stats.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            stats.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            stats.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            stats.generation_tokens)
        yield self._request_success(stats.finished_by_reason, snapshot.num_aborted)
        yield self._cache_config_info()
        yield self._pool_gauge("kvserve:kv_cache_blocks", "KV cache blocks by state: used (referenced by requests), "
                               "cached (unreferenced, holding a reusable prefix, evictable), free.", 1, census)
        yield self._pool_gauge("kvserve:kv_cache_bytes", "KV cache bytes by state (blocks x bytes per block).",
                               self.block_bytes, census)
        yield self._gauge("kvserve:kv_cache_capacity_blocks", "KV cache blocks in the pool.", stats.num_blocks)
        yield self._gauge("kvserve:kv_cache_capacity_bytes", "KV cache pool size in bytes.",
                          stats.num_blocks * self.block_bytes)
        yield self._counter("kvserve:prefix_cache_evictions", "Cached blocks whose prefix was dropped for reuse.",
                            census.num_evictions)
        yield from self._tier_metrics(stats.tiers)
        yield from self._device_memory()

    def _tier_metrics(self, tiers: dict) -> Iterator[Metric]:
        """The KV tiers below the pool (host, disk), one label value per tier; nothing when none is configured."""
        if not tiers:
            return
        families = {
            "kvserve:kv_tier_queries": ("Blocks looked up in the tier after the pool and the tiers above missed.",
                                        lambda t: t.queries),
            "kvserve:kv_tier_hits": ("Blocks found in the tier and loaded back into the pool.", lambda t: t.hits),
            "kvserve:kv_tier_offloaded_blocks": ("Blocks written to the tier.", lambda t: t.offloaded_blocks),
            "kvserve:kv_tier_skipped_loads": ("Tier hits not loaded: the load would take longer than recomputing.",
                                              lambda t: t.skipped_slower_than_recompute),
            "kvserve:kv_tier_skipped_writes": ("Blocks not written to the tier: its write queue was full (a disk "
                                               "slower than blocks are evicted).", lambda t: t.skipped_writes),
        }
        for name, (doc, value) in families.items():
            family = CounterMetricFamily(name, doc, labels=LABELS + ["tier"])
            for tier, snapshot in tiers.items():
                family.add_metric(self.labels + [tier], value(snapshot))
            yield family
        moved = CounterMetricFamily("kvserve:kv_tier_bytes", "Bytes moved per tier and direction (in: offloaded to "
                                    "the tier, out: loaded back into the pool).", labels=LABELS + ["tier", "direction"])
        usage = GaugeMetricFamily("kvserve:kv_tier_usage_bytes", "Bytes the tier holds.", labels=LABELS + ["tier"])
        capacity = GaugeMetricFamily("kvserve:kv_tier_capacity_bytes", "Bytes the tier may hold.",
                                     labels=LABELS + ["tier"])
        latency = HistogramMetricFamily("kvserve:kv_tier_load_seconds", "Time to read one block from the tier.",
                                        labels=LABELS + ["tier"])
        for tier, snapshot in tiers.items():
            moved.add_metric(self.labels + [tier, "in"], snapshot.offloaded_bytes)
            moved.add_metric(self.labels + [tier, "out"], snapshot.loaded_bytes)
            usage.add_metric(self.labels + [tier], snapshot.used_bytes)
            capacity.add_metric(self.labels + [tier], snapshot.capacity_bytes)
            cumulative, buckets = 0, []
            for bound, count in zip([*LOAD_BUCKETS, float("inf")], snapshot.load_bucket_counts):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            latency.add_metric(self.labels + [tier], buckets, snapshot.load_seconds_sum)
        yield from (moved, usage, capacity, latency)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _request_success(self, by_reason: dict[str, int], num_aborted: int) -> CounterMetricFamily:
        family = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                     labels=LABELS + ["finished_reason"])
        counts = dict(by_reason)
        counts["abort"] = counts.get("abort", 0) + num_aborted
        for reason in FINISH_REASONS:
            family.add_metric(self.labels + [reason], counts.get(reason, 0))
        return family

    def _cache_config_info(self) -> GaugeMetricFamily:
        names = sorted(self.cache_info)
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=LABELS + names)
        family.add_metric(self.labels + [self.cache_info[n] for n in names], 1)
        return family

    def _pool_gauge(self, name: str, doc: str, scale: int, census) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS + ["state"])
        for state, blocks in (("used", census.num_used_blocks), ("cached", census.num_cached_blocks),
                              ("free", census.num_free_blocks)):
            family.add_metric(self.labels + [state], blocks * scale)
        return family

    def _device_memory(self) -> Iterator[Metric]:
        used, total = device_memory(self.device)
        labels = LABELS + ["device"]
        for name, doc, value in (
            ("kvserve:device_memory_used_bytes", "Device memory in use: GPU memory on CUDA (as nvidia-smi shows it), "
             "the process's resident memory on CPU.", used),
            ("kvserve:device_memory_total_bytes", "Device memory: the GPU's on CUDA, the machine's RAM on CPU.", total),
        ):
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=labels)
                family.add_metric(self.labels + [str(self.device)], value)
                yield family


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free, total
    return _process_rss_bytes(), _machine_ram_bytes()


def _process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _machine_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def cache_config_info(engine: AsyncLLMEngine) -> dict[str, str]:
    """vllm:cache_config_info's labels: the cache config as strings, plus the pool size the engine chose."""
    config = engine.engine.config.cache
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(config.kv_cache_dtype),
        "kv_format": engine.engine.pool.kv_format,  # what the pool stores: auto resolved, fp8 as fp8_e4m3
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(engine.engine.pool.num_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "prefix_caching_hash_algo": str(config.prefix_caching_hash_algo),
    }


def build_metrics(engine: AsyncLLMEngine, model_name: str) -> tuple[CollectorRegistry, RequestMetrics]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, model_name, cache_config_info(engine)))
    ProcessCollector(registry=registry)  # process_* (CPU seconds, RSS, open fds), as vLLM exposes them
    return registry, RequestMetrics(registry, model_name, engine.engine.max_model_len)
