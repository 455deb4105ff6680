"""Per-request block tables over the block pool, with automatic prefix caching.

How the scheduler drives it, per request:

1. Admission (first time, or again after preemption freed it):
   `hit = lookup_prefix(request)` (the pool's hits, continued into the KV tiers) then
   `allocate_slots(request, num_new_tokens, hit.num_tokens, hit.block_ids)`; None means "no room, stay waiting"
   and leaves no trace, so the scheduler can simply try again next step. `get_computed_blocks` is the pool's
   part alone, a pure lookup (the scheduler ranks waiting requests with it).
2. Every later step (prefill chunk or decode): `allocate_slots(request, num_new_tokens, num_computed_tokens)`.
3. Finish / abort / preemption: `free(request)`.

Contract with the runner and scheduler: `allocate_slots` registers the blocks it covers in the prefix cache
immediately, so a request admitted later in the same step can hit them. That is safe because the runner writes
every scheduled token's K/V before attention reads it, and it relies on the scheduler running the forward for
every request it allocated slots for in the step (vLLM's rule: a request scheduled in this step is never
preempted in the same step; preemption takes requests not yet scheduled).

Block hashes live on the request (`request.block_hashes`): they depend only on its tokens and salt, so they
are computed once per request and survive preemption; the manager appends to the list lazily as blocks fill.

Parallel sampling (n > 1) has no special path (no fork): siblings are separate requests with the same prompt,
and the first one's allocate_slots registers the prompt's full blocks, so the others hit them, even in the
same step. Each sibling computes only the partial last block (at least one token), which it must own anyway.
With prefix caching off siblings do not share, as in vLLM v1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.cache.block_hash import BlockHash, BlockHasher
from kvserve.cache.block_pool import BlockPool, KVBlock, PrefixCacheStats
from kvserve.cache.transfers import LOAD, OFFLOAD, FromOffload, Transfer

if TYPE_CHECKING:  # the bookkeeping stays torch-free; the tiers (torch) are handed in by the engine
    from kvserve.cache.storage.kv_tiers import KVTiers


class CacheRequest(Protocol):
    """What the manager needs from the engine's request object."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far; grows by appending only
    num_prompt_tokens: int
    cache_salt: str | None
    block_hashes: list[BlockHash]  # starts empty; owned by the request, appended to by the manager only


@dataclass(slots=True)
class PrefixHit:
    """What an admission found cached: its blocks in token order, their tokens, and the tokens loaded per tier."""

    block_ids: list[int]
    num_tokens: int
    loaded: dict[str, int]


NO_HIT = PrefixHit([], 0, {})


@dataclass(slots=True)
class RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks already registered in (or found in) the prefix cache; the next one to hash is this index.
    num_cached_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
    ) -> None:
        assert block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(block_size, hash_algo)
        self._requests: dict[str, RequestBlocks] = {}
        self.tiers: KVTiers | None = None
        self._transfers: list[Transfer] = []  # copies the bookkeeping decided, in order, not yet done
        self._offloading: dict[BlockHash, FromOffload] = {}  # of those, the evicted blocks by hash

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Blocks evicted from the pool go to `tiers`; admissions load what they hold (lookup_prefix). Both are
        ordered here and done by whoever runs the step (take_transfers)."""
        assert self.enable_prefix_caching, "the KV tiers find blocks by hash: they need prefix caching"
        self.tiers = tiers
        self.pool.record_evictions = True

    def take_transfers(self) -> list[Transfer]:
        """The block copies ordered since the last call, to be done in order before the step's forward writes
        any block: offloads of evicted blocks (still intact until then) and loads of tier payloads."""
        self._order_offloads()
        transfers, self._transfers = self._transfers, []
        self._offloading.clear()
        return transfers

    def _new_blocks(self, num_blocks: int) -> list[KVBlock]:
        blocks = self.pool.get_new_blocks(num_blocks)
        self._order_offloads()
        return blocks

    def _order_offloads(self) -> None:
        if self.pool.evicted:
            ids, hashes = zip(*self.pool.evicted)
            order = Transfer(OFFLOAD, list(ids), list(hashes))
            self._transfers.append(order)
            self._offloading.update((block_hash, FromOffload(order, i)) for i, block_hash in enumerate(hashes))
            self.pool.evicted.clear()

    # ---- read-only views -------------------------------------------------------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-evictable."""
        return self.pool.num_free_blocks

    @property
    def num_evictable_cached_blocks(self) -> int:
        """Of those, the ones still holding a cached prefix (hashed, ref 0)."""
        return self.pool.num_evictable_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref > 0), i.e. vLLM's kv_cache_usage_perc as 0..1."""
        return self.pool.usage

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order; [] if it holds none.

        Returns the live list (no copy per step): read it, never mutate it.
        """
        request_blocks = self._requests.get(request_id)
        return request_blocks.block_ids if request_blocks is not None else []

    def num_blocks_of(self, request_id: str) -> int:
        request_blocks = self._requests.get(request_id)
        return len(request_blocks.block_ids) if request_blocks is not None else 0

    # ---- prefix cache lookup -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[int], int]:  # the pool alone
        """Longest chain of cached full blocks matching the request's tokens from the first block.

        Capped so at least one token is left to compute (the last token's logits are needed to sample):
        at most (len(all_token_ids) - 1) // block_size blocks. For a fresh request that is prompt - 1; a
        request re-admitted after preemption recomputes prompt + generated tokens, so its generated blocks can
        hit too. Pure lookup: takes no references and records no stats (allocate_slots does, once it succeeds),
        so the scheduler may call it repeatedly, e.g. to rank waiting requests by cached prefix.
        Returns (block ids, number of computed tokens); ([], 0) with prefix caching off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        assert request.request_id not in self._requests, "cache lookup is for requests being admitted"
        token_ids = request.all_token_ids
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        block_hashes = request.block_hashes
        self.hasher.extend_block_hashes(block_hashes, token_ids, request.cache_salt, max_hit_blocks)
        cached_blocks = self.pool.cached_blocks
        hit_block_ids: list[int] = []
        for block_index in range(max_hit_blocks):
            block = cached_blocks.get(block_hashes[block_index])
            if block is None:
                break
            hit_block_ids.append(block.block_id)
        return hit_block_ids, len(hit_block_ids) * self.block_size

    def lookup_prefix(self, request: CacheRequest) -> PrefixHit:
        """An admission's one lookup of its cached prefix: the pool's hit chain, continued into the KV tiers, whose
        blocks are loaded into pool blocks and become ordinary cached ones. The hit's blocks go to
        allocate_slots as they are."""
        hit_ids, _ = self.get_computed_blocks(request)
        loaded_ids, loaded = self._load_from_tiers(request, hit_ids)
        hit_ids += loaded_ids
        return PrefixHit(hit_ids, len(hit_ids) * self.block_size, loaded)

    def _load_from_tiers(self, request: CacheRequest, hit_ids: list[int]) -> tuple[list[int], dict[str, int]]:
        """The blocks the tiers hold past the pool's hits, loaded (their ids) and the tokens loaded per tier. The
        pool's hits are held during the load so making room cannot evict them; the loaded blocks are released
        suffix first, as `free` releases a request's."""
        if self.tiers is None:
            return [], {}
        max_hit_blocks = (len(request.all_token_ids) - 1) // self.block_size
        if len(hit_ids) >= max_hit_blocks:
            return [], {}
        blocks = self.pool.blocks
        pinned = [blocks[block_id] for block_id in hit_ids]
        self.pool.touch(pinned)
        try:
            wanted = request.block_hashes[len(hit_ids):max_hit_blocks][: self.pool.num_free_blocks]
            found = self._find(wanted)
            if not found:
                return [], {}
            new_blocks = self._new_blocks(len(found))
            self._transfers.append(Transfer(LOAD, [block.block_id for block in new_blocks],
                                            [source for _, source, _ in found]))
            loaded: dict[str, int] = {}
            for block, (block_hash, _, tier) in zip(new_blocks, found):
                self.pool.cache_block(block, block_hash)
                loaded[tier] = loaded.get(tier, 0) + self.block_size
            self.pool.free_blocks(reversed(new_blocks))
            return [block.block_id for block in new_blocks], loaded
        finally:
            self.pool.free_blocks(reversed(pinned))

    def _find(self, wanted: list[BlockHash]) -> list[tuple[BlockHash, object, str]]:
        """(hash, source, tier name) of the longest run of `wanted` the tiers hold or this step evicted (a block
        whose offload, ordered before the load, reads it for the load too)."""
        found = []
        for block_hash in wanted:
            pending = self._offloading.get(block_hash)
            if pending is not None:
                pending.order.kept.add(pending.index)
                found.append((block_hash, pending, self.tiers.tiers[0].name))
                continue
            hit = self.tiers.find([block_hash], self.block_size)
            if not hit:
                break
            found += hit
        return found

    def offload_cached(self, block_hashes: list[BlockHash]) -> int:
        """Moves the unreferenced cached blocks among `block_hashes` to the KV tiers and frees them in the pool
        (the idle-session policy); blocks a running request holds stay. Returns how many moved."""
        if self.tiers is None:
            return 0
        pool = self.pool
        blocks = [block for block_hash in block_hashes
                  if (block := pool.cached_blocks.get(block_hash)) is not None and block.ref_cnt == 0]
        if blocks:
            self.tiers.offload([block.block_id for block in blocks], [block.block_hash for block in blocks])
            for block in blocks:
                pool.uncache(block)
        return len(blocks)

    # ---- allocation ------------------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int] = (),
    ) -> list[int] | None:
        """Grow the request's block table to cover num_computed_tokens + num_new_tokens tokens.

        `new_computed_blocks` (from get_computed_blocks, at admission only) go first in the table, with a
        reference taken on each. Returns the newly allocated block ids ([] if none were needed: test the result
        with `is None`), or None, with nothing changed, when the pool cannot supply them.

        The first successful call for a request (an admission) records prefix cache stats: queries += its
        tokens, hits += num_computed_tokens. Counting here rather than in get_computed_blocks keeps the
        counters exact when an admission fails and is retried next step.
        """
        assert num_new_tokens >= 0 and num_computed_tokens >= 0
        block_size = self.block_size
        request_blocks = self._requests.get(request.request_id)
        is_admission = request_blocks is None
        num_held_blocks = 0 if request_blocks is None else len(request_blocks.block_ids)
        if new_computed_blocks:
            assert is_admission, "cache hits attach only when a request is admitted"
            assert self.enable_prefix_caching
            if __debug__:
                self._check_hits_still_cached(request, new_computed_blocks)
        num_table_blocks = num_held_blocks + len(new_computed_blocks)
        assert num_computed_tokens <= num_table_blocks * block_size, "computed tokens must already have slots"

        num_total_tokens = num_computed_tokens + num_new_tokens
        num_blocks_to_allocate = max(0, -(-num_total_tokens // block_size) - num_table_blocks)
        # A hit on a ref-0 cached block takes it out of the free queue: it counts against the free blocks too,
        # or the same block would be promised both as a hit and as a fresh block to evict.
        blocks = self.pool.blocks
        num_evictable_hits = sum(1 for block_id in new_computed_blocks if blocks[block_id].ref_cnt == 0)
        if num_blocks_to_allocate + num_evictable_hits > self.pool.num_free_blocks:
            return None

        if request_blocks is None:
            request_blocks = RequestBlocks()
            self._requests[request.request_id] = request_blocks
        block_ids = request_blocks.block_ids
        if new_computed_blocks:
            # Touch before allocating, so the hits are off the free queue before anything is evicted from it.
            self.pool.touch(blocks[block_id] for block_id in new_computed_blocks)
            block_ids.extend(new_computed_blocks)
            request_blocks.num_cached_blocks = len(new_computed_blocks)
        new_block_ids = [block.block_id for block in self._new_blocks(num_blocks_to_allocate)]
        block_ids.extend(new_block_ids)

        if self.enable_prefix_caching:
            if is_admission:
                self._record_admission(request, num_computed_tokens)
            # Only tokens both known and scheduled: a block whose K/V this step will not write is not a hit.
            self._cache_full_blocks(request, request_blocks, min(num_total_tokens, len(request.all_token_ids)))
        return new_block_ids

    def _record_admission(self, request: CacheRequest, num_computed_tokens: int) -> None:
        stats = self.pool.stats
        stats.requests += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += num_computed_tokens

    def _cache_full_blocks(self, request: CacheRequest, request_blocks: RequestBlocks, num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        first_uncached = request_blocks.num_cached_blocks
        if num_full_blocks <= first_uncached:
            return
        block_hashes = request.block_hashes
        self.hasher.extend_block_hashes(block_hashes, request.all_token_ids, request.cache_salt, num_full_blocks)
        blocks = self.pool.blocks
        block_ids = request_blocks.block_ids
        for block_index in range(first_uncached, num_full_blocks):
            # A False return (same content already cached by a concurrent request) needs no action.
            self.pool.cache_block(blocks[block_ids[block_index]], block_hashes[block_index])
        request_blocks.num_cached_blocks = num_full_blocks

    def _check_hits_still_cached(self, request: CacheRequest, new_computed_blocks: Sequence[int]) -> None:
        # Hits go stale if anything allocated between get_computed_blocks and allocate_slots.
        for block_index, block_id in enumerate(new_computed_blocks):
            block = self.pool.blocks[block_id]
            assert block.block_hash is not None and block.block_hash == request.block_hashes[block_index], (
                f"hit block {block_id} was evicted or reused before allocate_slots"
            )

    # ---- release ---------------------------------------------------------------------------------------

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks and forget its table. A no-op for a request that holds none.

        Blocks are released last-first, so of the request's cached blocks the suffix is evicted before the
        prefix (the prefix is the part other requests are most likely to share).
        """
        request_blocks = self._requests.pop(request.request_id, None)
        if request_blocks is None:
            return
        blocks = self.pool.blocks
        self.pool.free_blocks(blocks[block_id] for block_id in reversed(request_blocks.block_ids))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Like vLLM, refused (False, nothing changed) while any block is in use.
        Stats counters are cumulative and are not reset."""
        return self.pool.reset_prefix_cache()

    # ---- testing -----------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Pool invariants plus: each block's ref count equals the number of tables holding it. O(pool)."""
        self.pool.check_invariants()
        num_tables_holding = [0] * self.num_blocks
        for request_id, request_blocks in self._requests.items():
            block_ids = request_blocks.block_ids
            assert len(set(block_ids)) == len(block_ids), f"request {request_id} holds a block twice"
            assert request_blocks.num_cached_blocks <= len(block_ids)
            for block_id in block_ids:
                num_tables_holding[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == num_tables_holding[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {num_tables_holding[block.block_id]}"
            )
        assert self.pool.num_used_blocks == sum(1 for held in num_tables_holding if held > 0)
