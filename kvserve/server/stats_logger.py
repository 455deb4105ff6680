"""The periodic one-line engine summary (vLLM's "Avg prompt throughput ..." line), from the engine snapshot."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvserve.engine.async_engine import AsyncLLMEngine, EngineSnapshot

logger = logging.getLogger("kvserve.stats")


@dataclass(slots=True)
class StatsLine:
    prompt_throughput: float
    generation_throughput: float
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_hit_rate: float

    def format(self) -> str:
        return (
            f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, "
            f"Running: {self.num_running} reqs, Waiting: {self.num_waiting} reqs, "
            f"Preemptions: {self.num_preemptions}, KV cache usage: {self.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self.prefix_hit_rate * 100:.1f}%"
        )

    @property
    def idle(self) -> bool:
        return not (self.prompt_throughput or self.generation_throughput or self.num_running or self.num_waiting)


def stats_line(previous: EngineSnapshot, current: EngineSnapshot) -> StatsLine:
    before, now = previous.stats, current.stats
    elapsed = max(current.taken_at - previous.taken_at, 1e-9)
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    hits = now.prefix_cache_hits - before.prefix_cache_hits
    # The hit rate of this interval when there were lookups; otherwise the lifetime rate, which is still true.
    hit_rate = hits / queries if queries else (now.prefix_cache_hits / now.prefix_cache_queries
                                               if now.prefix_cache_queries else 0.0)
    return StatsLine(
        prompt_throughput=(now.prompt_tokens - before.prompt_tokens) / elapsed,
        generation_throughput=(now.generation_tokens - before.generation_tokens) / elapsed,
        num_running=now.num_running,
        num_waiting=now.num_waiting,
        num_preemptions=now.num_preemptions,
        kv_cache_usage=now.kv_cache_usage,
        prefix_hit_rate=hit_rate,
    )


async def log_stats_forever(engine: AsyncLLMEngine, interval_s: float) -> None:
    previous = engine.snapshot
    was_idle = True
    while True:
        await asyncio.sleep(interval_s)
        current = engine.snapshot
        if current is previous:
            continue  # the engine published nothing new: it is idle and was already reported as such
        line = stats_line(previous, current)
        if not (line.idle and was_idle):  # one line after activity stops, then silence until it resumes
            logger.info(line.format())
        was_idle = line.idle
        previous = current
