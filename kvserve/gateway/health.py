"""Health checks: every interval each backend's `/health` says whether it is up and its `/metrics` gives its
load (vLLM's gauge names, summed over models and engines), and whether its cache lost what the prefix index
says it holds: its counters started again (a restart: an empty cache), or since some earlier check it has
evicted as many blocks as its pool holds (its cache is LRU: everything it held at that check is gone)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from kvserve.gateway.backends import Backend, BackendLoad

logger = logging.getLogger("kvserve.gateway")

LOAD_METRICS = {
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_running": "num_running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "kvserve:prefix_cache_evictions_total": "evictions",
    "kvserve:kv_cache_capacity_blocks": "capacity_blocks",
}
RESTART, EVICTIONS = "restart", "evictions"

# Called with (backend, horizon, reason) when a backend's cache lost the entries recorded at or before horizon.
CacheLost = Callable[[Backend, float, str], None]


def parse_load(metrics_text: str) -> BackendLoad:
    """The load gauges and counters, summed over their label sets. Only the lines of those metrics are parsed:
    prometheus_client's parser took ~17 ms of the gateway's event loop for a kvserve backend's 37 kB page (every
    family, histograms included), three backends every health interval, a stall any request then waits out."""
    load = BackendLoad()
    for line in metrics_text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        name_end = brace if 0 <= brace < space else space
        attribute = LOAD_METRICS.get(line[:name_end])
        if attribute is None:
            continue
        rest = line[line.rindex("}") + 1:] if name_end == brace else line[space:]
        try:
            value = float(rest.split()[0])  # a timestamp may follow the value
        except (IndexError, ValueError):
            continue
        setattr(load, attribute, getattr(load, attribute) + value)
    return load


def cache_lost(backend: Backend, load: BackendLoad, now: float) -> tuple[float, str] | None:
    """(horizon, reason) when this /metrics read shows the backend lost what it cached up to a time it had not
    been reported to have lost before, else None. Notes the read in the backend's eviction marks."""
    if load.prefix_cache_queries < backend.load.prefix_cache_queries:
        backend.eviction_marks.clear()
        lost = (now, RESTART)
    else:
        horizon = eviction_horizon(backend.eviction_marks, load.evictions, load.capacity_blocks)
        lost = (horizon, EVICTIONS) if horizon is not None else None
    backend.eviction_marks.append((now, load.evictions))
    if lost is None or lost[0] <= backend.cache_horizon:
        return None
    backend.cache_horizon = lost[0]
    return lost


def eviction_horizon(marks, evictions: float, capacity_blocks: float) -> float | None:
    """The latest mark (time, evictions then) since which at least a whole pool was evicted."""
    if capacity_blocks <= 0:
        return None
    for at, evictions_then in reversed(marks):
        if evictions - evictions_then >= capacity_blocks:
            return at
    return None


async def check_backend(http: aiohttp.ClientSession, backend: Backend, timeout: aiohttp.ClientTimeout,
                        on_cache_lost: CacheLost | None = None) -> None:
    try:
        health_status, _ = await _get(http, f"{backend.url}/health", backend.headers, timeout)
        metrics_status, metrics_text = await _get(http, f"{backend.url}/metrics", backend.headers, timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # a total timeout is a bare asyncio.TimeoutError
        _set_health(backend, False, f"{type(exc).__name__}")
        return
    if health_status != 200:
        _set_health(backend, False, f"/health answered {health_status}")
        return
    if metrics_status == 200:
        load, now = parse_load(metrics_text), time.time()
        lost = cache_lost(backend, load, now)
        if lost is not None and on_cache_lost is not None:
            on_cache_lost(backend, *lost)
        backend.load = load
    _set_health(backend, True, "")


async def _get(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
               timeout: aiohttp.ClientTimeout) -> tuple[int, str]:
    async with http.get(url, headers=headers, timeout=timeout) as response:
        return response.status, await response.text(errors="replace")


def _set_health(backend: Backend, healthy: bool, why: str) -> None:
    if backend.healthy != healthy:
        logger.warning("backend %s is %s%s", backend.shown_url, "up" if healthy else "down", f" ({why})" if why else "")
    backend.healthy = healthy


async def check_all(http: aiohttp.ClientSession, backends: list[Backend], timeout: aiohttp.ClientTimeout,
                    on_cache_lost: CacheLost | None = None) -> None:
    await asyncio.gather(*(check_backend(http, backend, timeout, on_cache_lost) for backend in backends))


async def health_loop(http: aiohttp.ClientSession, backends: list[Backend], timeout: aiohttp.ClientTimeout,
                      interval_s: float, on_cache_lost: CacheLost | None = None) -> None:
    while True:
        await check_all(http, backends, timeout, on_cache_lost)
        await asyncio.sleep(interval_s)
