"""The client's figures of a run: latency distributions, throughput, goodput, errors by kind."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvserve.bench.records import RequestRecord


@dataclass(slots=True)
class Distribution:
    """In milliseconds. Percentiles interpolate linearly (numpy's default, as vLLM's benchmark)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float


def distribution_ms(values_s: list[float]) -> Distribution | None:
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return Distribution(len(ms), float(ms.mean()), float(p50), float(p95), float(p99), float(ms.max()))


@dataclass(slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = record.time_per_output_token_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass(slots=True)
class Summary:
    num_sent: int
    num_completed: int
    num_failed: int
    errors_by_kind: dict[str, int]
    first_error_by_kind: dict[str, str]  # the message of each kind's first request, the one to read first
    duration_s: float
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # completion tokens of completed requests / s
    total_token_throughput: float  # prompt + completion tokens / s
    prompt_tokens: int  # from usage, completed requests
    completion_tokens: int
    cached_tokens: int | None  # None: the server reported no cached tokens
    cache_hit_rate: float | None  # cached / prompt tokens, from usage
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    num_within_slo: int | None = None
    goodput: float | None = None  # requests / s that met every SLO


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    completed = [r for r in records if r.ok]
    errors = Counter(r.error_kind or "unknown" for r in records if not r.ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in completed)
    completion_tokens = sum(r.output_tokens for r in completed)
    reported_cache = [r.cached_tokens for r in completed if r.cached_tokens is not None]
    cached = sum(reported_cache) if reported_cache else None
    per_second = (lambda amount: amount / duration_s) if duration_s > 0 else (lambda amount: 0.0)
    summary = Summary(
        num_sent=len(records), num_completed=len(completed), num_failed=len(records) - len(completed),
        errors_by_kind=dict(sorted(errors.items())), first_error_by_kind=first_errors(records),
        duration_s=duration_s,
        request_throughput=per_second(len(completed)), output_token_throughput=per_second(completion_tokens),
        total_token_throughput=per_second(prompt_tokens + completion_tokens),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached,
        cache_hit_rate=(cached / prompt_tokens) if cached is not None and prompt_tokens else None,
        ttft=distribution_ms([r.ttft_s for r in completed if r.ttft_s is not None]),
        tpot=distribution_ms([t for r in completed if (t := r.time_per_output_token_s) is not None]),
        itl=distribution_ms([gap for r in completed for gap in r.inter_token_latencies_s]),
        e2e=distribution_ms([r.e2e_s for r in completed if r.e2e_s is not None]),
    )
    if slo is not None and slo.is_set:
        summary.slo_ttft_ms, summary.slo_tpot_ms = slo.ttft_ms, slo.tpot_ms
        summary.num_within_slo = sum(slo.met_by(r) for r in records)
        summary.goodput = per_second(summary.num_within_slo)
    return summary


def first_errors(records: list[RequestRecord]) -> dict[str, str]:
    """Per error kind, the message of the earliest sent request that failed so (by kind, as errors_by_kind)."""
    first: dict[str, RequestRecord] = {}
    for record in sorted((r for r in records if not r.ok), key=lambda r: r.start_s):
        first.setdefault(record.error_kind or "unknown", record)
    return {kind: first[kind].error_message or "" for kind in sorted(first)}


def output_token_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start s, output tokens/s in that bin) over the run, each chunk weighted by its request's tokens per
    chunk (usage's count over the chunks seen)."""
    ends = [r.start_s + t for r in records for t in r.chunk_times_s]
    if not ends:
        return []
    counts = np.zeros(int(math.floor(max(ends) / bin_s)) + 1)
    for record in records:
        if not record.chunk_times_s:
            continue
        weight = record.output_tokens / len(record.chunk_times_s)
        for t in record.chunk_times_s:
            counts[int((record.start_s + t) / bin_s)] += weight
    return [(index * bin_s, float(count / bin_s)) for index, count in enumerate(counts)]
