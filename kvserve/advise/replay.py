"""Replaying prompts through the engine's own prefix cache bookkeeping to predict the hit rate.

The replay drives a real `KVCacheManager` (the pool, the chained xxh3 block hashes, the LRU free queue, the
hit capped at prompt length - 1, only full blocks hashed) with each request in log order, one at a time: look
up the cached prefix, allocate the prompt and the generated tokens, register their full blocks, free them (the
suffix first, as the engine does). So the only thing the replay does not model is concurrency: requests that
overlap in the engine can hit blocks a moment later, or earlier, than in a sequential replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.advise.records import PoolShape, PromptRecord
from kvserve.cache.kv_cache_manager import KVCacheManager



@dataclass(slots=True)
class _ReplayRequest:
    """What the manager needs of a request (kv_cache_manager.CacheRequest)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None
    block_hashes: list = field(default_factory=list)


@dataclass(slots=True)
class ReplayResult:
    hit_tokens: list[int]  # per record, summed over its choices
    prompt_tokens: list[int]
    num_unplaced: int  # requests the pool could not hold at all (prompt larger than the pool)

    @property
    def hit_rate(self) -> float:
        return hit_rate(sum(self.hit_tokens), sum(self.prompt_tokens))


def hit_rate(hits: int, queries: int) -> float:
    return hits / queries if queries else 0.0


def replay(records: list[PromptRecord], pool: PoolShape, token_ids: list[list[int]] | None = None) -> ReplayResult:
    """`token_ids`: per record, the prompt to replay instead of the record's own (a fix's rewrite)."""
    num_blocks = pool.num_blocks or _blocks_for_everything(records, pool.block_size, token_ids)
    manager = KVCacheManager(num_blocks, pool.block_size, True, pool.hash_algo)
    hits, queries, num_unplaced = [], [], 0
    for position, record in enumerate(records):
        prompt = token_ids[position] if token_ids is not None else record.token_ids
        assert prompt is not None, "records are tokenized before they are replayed"
        record_hits = 0
        for choice, output in enumerate(record.output_token_ids or [[]]):
            request = _ReplayRequest(f"{record.index}-{choice}", list(prompt), len(prompt), record.cache_salt)
            placed_hits = _run_request(manager, request, output)
            num_unplaced += placed_hits is None
            record_hits += placed_hits or 0
        hits.append(record_hits)
        queries.append(len(prompt) * max(1, len(record.output_token_ids)))
    return ReplayResult(hits, queries, num_unplaced)


def _blocks_for_everything(records: list[PromptRecord], block_size: int, token_ids: list[list[int]] | None) -> int:
    """A pool size for an unknown pool: every block of every request fits, so nothing is ever evicted."""
    prompts = token_ids if token_ids is not None else [record.token_ids or [] for record in records]
    tokens = sum((len(prompt) + sum(len(output) for output in record.output_token_ids) + block_size)
                 * max(1, len(record.output_token_ids)) for prompt, record in zip(prompts, records))
    return tokens // block_size + 1


def _run_request(manager: KVCacheManager, request: _ReplayRequest, output: list[int]) -> int | None:
    """Prefill, then decode: the engine writes K/V for every token but the last one sampled."""
    blocks, num_computed = manager.get_computed_blocks(request)
    if manager.allocate_slots(request, len(request.all_token_ids) - num_computed, num_computed, blocks) is None:
        return None
    if len(output) > 1:
        request.all_token_ids.extend(output[:-1])
        manager.allocate_slots(request, len(output) - 1, request.num_prompt_tokens)
    manager.free(request)
    return num_computed
