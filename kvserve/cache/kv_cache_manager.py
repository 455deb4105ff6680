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
from kvserve.planner.kv_groups import first_needed_block

if TYPE_CHECKING:  # the bookkeeping stays torch-free; the tiers (torch) are handed in by the engine
    from kvserve.cache.storage.kv_tiers import KVTiers

# The table entry of a block a window group no longer holds: attention never reads a block outside its window,
# and pool blocks are always finite (zero-filled at start), so the padding id is safe where a path reads it anyway.
RELEASED_BLOCK = 0

GroupBlockIds = tuple[list[int], ...]  # per KV cache group, block ids in token order


class CacheRequest(Protocol):
    """What the manager needs from the engine's request object."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far; grows by appending only
    num_prompt_tokens: int
    cache_salt: str | None
    block_hashes: list[BlockHash]  # starts empty; owned by the request, appended to by the manager only


@dataclass(slots=True)
class PrefixHit:
    """What an admission found cached: per group its blocks in token order (RELEASED_BLOCK where a window group
    needs none), their tokens, and the tokens loaded per tier."""

    block_ids: GroupBlockIds
    num_tokens: int
    loaded: dict[str, int]


NO_HIT = PrefixHit((), 0, {})


@dataclass(slots=True)
class GroupBlocks:
    """One group's table of one request."""

    block_ids: list[int] = field(default_factory=list)
    # Leading entries given back (window groups: out of every later query's window); they read RELEASED_BLOCK.
    num_released: int = 0
    # Leading blocks already registered in (or found in) the prefix cache; the next one to hash is this index.
    num_cached_blocks: int = 0

    @property
    def held(self) -> list[int]:
        return self.block_ids[self.num_released:]


@dataclass(slots=True)
class RequestBlocks:
    groups: list[GroupBlocks]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        """`group_windows`: the sliding window of each KV cache group (planner/kv_groups.py), None for full
        attention; one group (the default) is a model whose layers all attend alike."""
        assert block_size > 0 and group_windows
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(block_size, hash_algo)
        self._requests: dict[str, RequestBlocks] = {}
        self.tiers: KVTiers | None = None
        self._transfers: list[Transfer] = []  # copies the bookkeeping decided, in order, not yet done
        self._offloading: dict[BlockHash, FromOffload] = {}  # of those, the evicted blocks by cache key

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def cache_key(self, group: int, block_hash: BlockHash) -> BlockHash:
        """What a group's block is cached (and offloaded) under: the block hash itself for the first group, so a
        one-group model's keys are its hashes; the hash and the group's index for the others."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

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
            ids, keys = zip(*self.pool.evicted)
            order = Transfer(OFFLOAD, list(ids), list(keys))
            self._transfers.append(order)
            self._offloading.update((key, FromOffload(order, i)) for i, key in enumerate(keys))
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

    def get_block_tables(self, request_id: str) -> GroupBlockIds:
        """The request's block ids per group in token order (RELEASED_BLOCK where a window group gave a block
        back); empty lists if it holds none. The live lists (no copy per step): read them, never mutate them."""
        request_blocks = self._requests.get(request_id)
        if request_blocks is None:
            return tuple([] for _ in self.group_windows)
        return tuple(group.block_ids for group in request_blocks.groups)

    def get_block_table(self, request_id: str) -> list[int]:
        """The first group's table (a one-group model's only one)."""
        return self.get_block_tables(request_id)[0]

    def num_blocks_of(self, request_id: str) -> int:
        """Pool blocks the request holds, over all groups."""
        request_blocks = self._requests.get(request_id)
        if request_blocks is None:
            return 0
        return sum(len(group.block_ids) - group.num_released for group in request_blocks.groups)

    # ---- prefix cache lookup -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: CacheRequest) -> tuple[GroupBlockIds, int]:  # the pool alone
        """Longest cached prefix of the request's tokens, in whole blocks, that every group can continue from: a
        full-attention group needs every block of it, a window group the blocks its window still covers (vLLM's
        rule for hybrid models).

        Capped so at least one token is left to compute (the last token's logits are needed to sample):
        at most (len(all_token_ids) - 1) // block_size blocks. For a fresh request that is prompt - 1; a
        request re-admitted after preemption recomputes prompt + generated tokens, so its generated blocks can
        hit too. Pure lookup: takes no references and records no stats (allocate_slots does, once it succeeds),
        so the scheduler may call it repeatedly, e.g. to rank waiting requests by cached prefix.
        Returns (block ids per group, number of computed tokens); nothing with prefix caching off.
        """
        if not self.enable_prefix_caching:
            return self._no_blocks(), 0
        assert request.request_id not in self._requests, "cache lookup is for requests being admitted"
        cached = self.pool.cached_blocks
        num_blocks = self._hit_length(request, lambda key: key in cached)
        return self._hit_ids(request, num_blocks), num_blocks * self.block_size

    def _no_blocks(self) -> GroupBlockIds:
        return tuple([] for _ in self.group_windows)

    def _hit_length(self, request: CacheRequest, has) -> int:
        """The most leading blocks every group can take as a hit, `has(cache key)` telling which blocks are there."""
        token_ids = request.all_token_ids
        longest = (len(token_ids) - 1) // self.block_size
        block_hashes = request.block_hashes
        self.hasher.extend_block_hashes(block_hashes, token_ids, request.cache_salt, longest)
        num_blocks = longest
        while True:  # each group shortens the hit until all agree (a window group's valid lengths have gaps)
            agreed = num_blocks
            for group in range(self.num_groups):
                num_blocks = self._group_hit_length(group, block_hashes, num_blocks, has)
            if num_blocks == agreed:
                return num_blocks

    def _group_hit_length(self, group: int, block_hashes: list[BlockHash], longest: int, has) -> int:
        """The longest hit of at most `longest` blocks whose blocks from the group's first needed one are there.
        Full attention needs every block: the chain from the first, up to its first miss (nothing past it is asked
        for, so the tiers read no payload in vain). A window needs a run of blocks that ends the hit: found from
        the end."""
        window, size = self.group_windows[group], self.block_size
        if window is None:
            for index in range(longest):
                if not has(self.cache_key(group, block_hashes[index])):
                    return index
            return longest
        num_blocks = longest
        for index in range(longest - 1, -1, -1):
            if index < first_needed_block(window, num_blocks * size, size):
                break
            if not has(self.cache_key(group, block_hashes[index])):
                num_blocks = index
        return num_blocks

    def _needed_keys(self, request: CacheRequest, num_blocks: int) -> list[tuple[int, list[BlockHash]]]:
        """Per group: how many leading blocks of a `num_blocks` hit it needs none of, and the cache keys of the rest."""
        needed = []
        for group, window in enumerate(self.group_windows):
            first = min(first_needed_block(window, num_blocks * self.block_size, self.block_size), num_blocks)
            needed.append((first, [self.cache_key(group, h) for h in request.block_hashes[first:num_blocks]]))
        return needed

    def _hit_ids(self, request: CacheRequest, num_blocks: int) -> GroupBlockIds:
        cached = self.pool.cached_blocks
        return tuple([RELEASED_BLOCK] * first + [cached[key].block_id for key in keys]
                     for first, keys in self._needed_keys(request, num_blocks))

    def lookup_prefix(self, request: CacheRequest) -> PrefixHit:
        """An admission's one lookup of its cached prefix: the pool's hit, continued into the KV tiers, whose blocks
        are loaded into pool blocks and become ordinary cached ones. The hit's blocks go to allocate_slots as
        they are."""
        hit_ids, num_tokens = self.get_computed_blocks(request)
        longest = (len(request.all_token_ids) - 1) // self.block_size
        if self.tiers is not None and num_tokens < longest * self.block_size:
            loaded = self._load_from_tiers(request)
            if loaded is not None:
                return loaded
        return PrefixHit(hit_ids, num_tokens, {})

    def _load_from_tiers(self, request: CacheRequest) -> PrefixHit | None:
        """A longer hit than the pool's, its missing blocks loaded from the tiers into new pool blocks (which become
        ordinary cached ones); None when the tiers add nothing or the pool has no room for them. The hit's pool
        blocks are held during the load so making room cannot evict them."""
        cached, found = self.pool.cached_blocks, {}

        def has(key: BlockHash) -> bool:
            if key in cached:
                return True
            if key not in found:
                found[key] = self._find(key)
            return found[key] is not None

        num_blocks = self._hit_length(request, has)
        keys = [key for _, group_keys in self._needed_keys(request, num_blocks) for key in group_keys]
        missing = [key for key in keys if key not in cached]
        if not missing:
            return None
        pinned = [cached[key] for key in keys if key in cached]
        self.pool.touch(pinned)
        try:
            if len(missing) > self.pool.num_free_blocks:
                return None
            new_blocks = self._new_blocks(len(missing))
            self._transfers.append(Transfer(LOAD, [block.block_id for block in new_blocks],
                                            [found[key][0] for key in missing]))
            loaded: dict[str, int] = {}
            for block, key in zip(new_blocks, missing):
                self.pool.cache_block(block, key)
                tier = found[key][1]
                loaded[tier] = loaded.get(tier, 0) + self.block_size
            self.pool.free_blocks(reversed(new_blocks))
        finally:
            self.pool.free_blocks(reversed(pinned))
        return PrefixHit(self._hit_ids(request, num_blocks), num_blocks * self.block_size, loaded)

    def _find(self, key: BlockHash) -> tuple[object, str] | None:
        """(source, tier name) of a block the tiers hold or this step evicted (a block whose offload, ordered
        before the load, reads it for the load too); None if neither has it."""
        pending = self._offloading.get(key)
        if pending is not None:
            pending.order.kept.add(pending.index)
            return pending, self.tiers.tiers[0].name
        hit = self.tiers.find([key], self.block_size)
        return (hit[0][1], hit[0][2]) if hit else None

    def offload_cached(self, block_hashes: list[BlockHash]) -> int:
        """Moves the unreferenced cached blocks of every group among `block_hashes` to the KV tiers and frees them
        in the pool (the idle-session policy); blocks a running request holds stay. Returns how many moved."""
        if self.tiers is None:
            return 0
        pool = self.pool
        keys = (self.cache_key(group, h) for group in range(self.num_groups) for h in block_hashes)
        blocks = [block for key in keys if (block := pool.cached_blocks.get(key)) is not None and block.ref_cnt == 0]
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
        new_computed_blocks: GroupBlockIds | None = None,
    ) -> list[int] | None:
        """Grow the request's block tables to cover num_computed_tokens + num_new_tokens tokens.

        A window group also gives back the blocks no query from num_computed_tokens on can see (they stay cached
        and evictable when hashed; the room they leave counts). `new_computed_blocks` (from get_computed_blocks / lookup_prefix, at
        admission only) go first in the tables, with a reference taken on each. Returns the newly allocated block
        ids ([] if none were needed: test the result with `is None`), or None, with nothing changed, when the pool
        cannot supply them.

        The first successful call for a request (an admission) records prefix cache stats: queries += its
        tokens, hits += num_computed_tokens. Counting here rather than in get_computed_blocks keeps the
        counters exact when an admission fails and is retried next step.
        """
        assert num_new_tokens >= 0 and num_computed_tokens >= 0
        block_size = self.block_size
        request_blocks = self._requests.get(request.request_id)
        is_admission = request_blocks is None
        hits = new_computed_blocks if new_computed_blocks and any(new_computed_blocks) else None
        if hits is not None:
            assert is_admission, "cache hits attach only when a request is admitted"
            assert self.enable_prefix_caching and len(hits) == self.num_groups
            if __debug__:
                self._check_hits_still_cached(request, hits, num_computed_tokens)
        else:
            hits = self._no_blocks()
        releasable = [] if request_blocks is None else self._out_of_window(request_blocks, num_computed_tokens)
        tables = request_blocks.groups if request_blocks is not None else [GroupBlocks() for _ in self.group_windows]

        num_total_tokens = num_computed_tokens + num_new_tokens
        num_table_blocks = [len(table.block_ids) + len(hit) for table, hit in zip(tables, hits)]
        assert all(num_computed_tokens <= n * block_size for n in num_table_blocks), "computed tokens need slots"
        num_needed = -(-num_total_tokens // block_size)
        num_blocks_to_allocate = [max(0, num_needed - n) for n in num_table_blocks]
        # A hit on a ref-0 cached block takes it out of the free queue: it counts against the free blocks too,
        # or the same block would be promised both as a hit and as a fresh block to evict.
        blocks = self.pool.blocks
        num_unheld = [min(first_needed_block(window, num_computed_tokens, block_size), len(hit))
                      for window, hit in zip(self.group_windows, hits)]
        hit_blocks = [blocks[block_id] for hit, first in zip(hits, num_unheld) for block_id in hit[first:]]
        num_evictable_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        num_freed = sum(1 for _, ids in releasable for block_id in ids if blocks[block_id].ref_cnt == 1)
        if sum(num_blocks_to_allocate) + num_evictable_hits > self.pool.num_free_blocks + num_freed:
            return None
        self._release(releasable)

        if request_blocks is None:
            request_blocks = RequestBlocks(tables)
            self._requests[request.request_id] = request_blocks
        # Touch before allocating, so the hits are off the free queue before anything is evicted from it.
        self.pool.touch(hit_blocks)
        new_block_ids = []
        for table, hit, first, count in zip(tables, hits, num_unheld, num_blocks_to_allocate):
            if hit:
                table.block_ids.extend(hit)
                table.num_released = first
                table.num_cached_blocks = len(hit)
            ids = [block.block_id for block in self._new_blocks(count)]
            table.block_ids.extend(ids)
            new_block_ids += ids

        if self.enable_prefix_caching:
            if is_admission:
                self._record_admission(request, num_computed_tokens)
            # Only tokens both known and scheduled: a block whose K/V this step will not write is not a hit.
            self._cache_full_blocks(request, request_blocks, min(num_total_tokens, len(request.all_token_ids)))
        return new_block_ids

    def _out_of_window(self, request_blocks: RequestBlocks, num_computed_tokens: int
                       ) -> list[tuple[GroupBlocks, list[int]]]:
        """Per window group, the blocks it holds before the first one a query at num_computed_tokens can see."""
        out = []
        for table, window in zip(request_blocks.groups, self.group_windows):
            first_needed = min(first_needed_block(window, num_computed_tokens, self.block_size), len(table.block_ids))
            if first_needed > table.num_released:
                out.append((table, table.block_ids[table.num_released:first_needed]))
        return out

    def _release(self, releasable: list[tuple[GroupBlocks, list[int]]]) -> None:
        """Gives the blocks back, oldest first (the pool evicts those first); hashed ones stay cached until evicted."""
        for table, block_ids in releasable:
            first = table.num_released
            table.block_ids[first:first + len(block_ids)] = [RELEASED_BLOCK] * len(block_ids)
            table.num_released += len(block_ids)
            self.pool.free_blocks(self.pool.blocks[block_id] for block_id in block_ids)

    def _record_admission(self, request: CacheRequest, num_computed_tokens: int) -> None:
        stats = self.pool.stats
        stats.requests += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += num_computed_tokens

    def _cache_full_blocks(self, request: CacheRequest, request_blocks: RequestBlocks, num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        block_hashes = request.block_hashes
        self.hasher.extend_block_hashes(block_hashes, request.all_token_ids, request.cache_salt, num_full_blocks)
        blocks = self.pool.blocks
        for group, table in enumerate(request_blocks.groups):
            first_uncached = max(table.num_cached_blocks, table.num_released)
            for block_index in range(first_uncached, num_full_blocks):
                # A False return (same content already cached by a concurrent request) needs no action.
                self.pool.cache_block(blocks[table.block_ids[block_index]],
                                      self.cache_key(group, block_hashes[block_index]))
            table.num_cached_blocks = max(table.num_cached_blocks, num_full_blocks)

    def _check_hits_still_cached(self, request: CacheRequest, hits: GroupBlockIds, num_hit_tokens: int) -> None:
        # Hits go stale if anything allocated between get_computed_blocks and allocate_slots.
        for group, hit in enumerate(hits):
            first = min(first_needed_block(self.group_windows[group], num_hit_tokens, self.block_size), len(hit))
            for block_index in range(first, len(hit)):
                block = self.pool.blocks[hit[block_index]]
                assert block.block_hash == self.cache_key(group, request.block_hashes[block_index]), (
                    f"hit block {block.block_id} was evicted or reused before allocate_slots"
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
        for table in request_blocks.groups:
            self.pool.free_blocks(blocks[block_id] for block_id in reversed(table.held))

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
            held = [block_id for table in request_blocks.groups for block_id in table.held]
            assert len(set(held)) == len(held), f"request {request_id} holds a block twice"
            for table in request_blocks.groups:
                assert table.num_cached_blocks <= len(table.block_ids) and table.num_released <= len(table.block_ids)
            for block_id in held:
                num_tables_holding[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == num_tables_holding[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {num_tables_holding[block.block_id]}"
            )
        assert self.pool.num_used_blocks == sum(1 for held in num_tables_holding if held > 0)
