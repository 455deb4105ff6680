"""Health checks: every interval each backend's `/health` says whether it is up and its `/metrics` gives its
load (vLLM's gauge names, summed over models and engines)."""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.gateway.backends import Backend, BackendLoad

logger = logging.getLogger("kvserve.gateway")

LOAD_METRICS = {
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_running": "num_running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


def parse_load(metrics_text: str) -> BackendLoad:
    load = BackendLoad()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            attribute = LOAD_METRICS.get(sample.name)
            if attribute is not None:
                setattr(load, attribute, getattr(load, attribute) + sample.value)
    return load


async def check_backend(http: httpx.AsyncClient, backend: Backend, headers: dict[str, str]) -> None:
    try:
        health = await http.get(f"{backend.url}/health", headers=headers)
        metrics = await http.get(f"{backend.url}/metrics", headers=headers)
    except httpx.HTTPError as exc:
        _set_health(backend, False, f"{type(exc).__name__}")
        return
    if health.status_code != 200:
        _set_health(backend, False, f"/health answered {health.status_code}")
        return
    if metrics.status_code == 200:
        backend.load = parse_load(metrics.text)
    _set_health(backend, True, "")


def _set_health(backend: Backend, healthy: bool, why: str) -> None:
    if backend.healthy != healthy:
        logger.warning("backend %s is %s%s", backend.url, "up" if healthy else "down", f" ({why})" if why else "")
    backend.healthy = healthy


async def check_all(http: httpx.AsyncClient, backends: list[Backend], headers: dict[str, str]) -> None:
    await asyncio.gather(*(check_backend(http, backend, headers) for backend in backends))


async def health_loop(http: httpx.AsyncClient, backends: list[Backend], headers: dict[str, str],
                      interval_s: float) -> None:
    while True:
        await check_all(http, backends, headers)
        await asyncio.sleep(interval_s)
