"""The pool of KV blocks: states, reference counts, the O(1) free queue and the hash -> block map.

Every block is in exactly one state:

- free:              ref_cnt == 0, block_hash is None,     in the free queue
- cached-evictable:  ref_cnt == 0, block_hash is not None, in the free queue (and in the hash map)
- in use:            ref_cnt > 0,                          not in the free queue

The free queue is a doubly linked list threaded through the blocks themselves, so a hit on a cached-evictable
block can take it out of the middle of the queue in O(1). Its order is the eviction order: allocation pops
the head. Freed unhashed blocks go to the head (nothing is lost by reusing them first); freed hashed blocks go
to the tail, so the least recently freed cached block is evicted first (LRU).

Block 0 is an ordinary block: no id is reserved for padding. The model runner pads block tables with 0 and
masks by sequence length, so a padded entry is never read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvserve.cache.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """Bookkeeping for one block of `block_size` token slots. The K/V tensors live in cache storage."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the hash map (cached), None otherwise.
    block_hash: BlockHash | None = None
    # Free-queue links; both None exactly when the block is not in the queue. Excluded from repr/compare
    # because they point along the whole list.
    prev_free: KVBlock | None = field(default=None, repr=False, compare=False)
    next_free: KVBlock | None = field(default=None, repr=False, compare=False)


class FreeBlockQueue:
    """Doubly linked list of ref-0 blocks in eviction order; every operation is O(1) (popleft_n is O(n)).

    Sentinel head and tail blocks remove the empty-list special cases from every operation.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        """Head (evicted next) to tail (most recently freed). For tests and debugging, not hot paths."""
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise IndexError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        popped: list[KVBlock] = []
        block = self._head.next_free
        for _ in range(num_blocks):
            assert block is not None
            next_block = block.next_free
            block.prev_free = block.next_free = None
            popped.append(block)
            block = next_block
        # Relink once for the whole run instead of once per block.
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return popped

    def remove(self, block: KVBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        assert prev_block is not None and next_block is not None, f"block {block.block_id} is not in the free queue"
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        """Insert at the tail: evicted last."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head: reused first."""
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already queued"
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def check_links(self) -> list[KVBlock]:
        """Walk the list, asserting every link is mutual; returns the blocks head to tail."""
        blocks: list[KVBlock] = []
        previous = self._head
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None, "free queue is broken: reached None before the tail"
            assert block.prev_free is previous, f"block {block.block_id}: prev link does not match"
            blocks.append(block)
            assert len(blocks) <= self.num_free_blocks, "free queue is longer than its count (a cycle?)"
            previous, block = block, block.next_free
        assert self._tail.prev_free is previous, "tail's prev link does not match"
        assert len(blocks) == self.num_free_blocks, f"free queue holds {len(blocks)}, count {self.num_free_blocks}"
        return blocks


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters (never reset, so they map onto Prometheus `_total` counters).

    queries / hits are in tokens with vLLM's `prefix_cache_queries` / `prefix_cache_hits` semantics.
    """

    requests: int = 0  # admissions counted (first admissions and re-admissions after preemption)
    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens found in the cache
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Owns the blocks, their ref counts, the free queue and (with prefix caching) the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash. If two requests fill blocks with the same content concurrently, the first one
        # registered keeps the hash and the other block stays unhashed (see cache_block).
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.num_evictable_cached = 0  # hashed blocks with ref_cnt 0: free to take, still holding a prefix
        self.stats = PrefixCacheStats()
        # With KV tiers, the (block id, hash) of each cached block an allocation evicts, for the cache manager to
        # turn into an offload order: its K/V is intact until the step's forward writes the block.
        self.record_evictions = False
        self.evicted: list[tuple[int, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take: free plus cached-evictable."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the head of the free queue with ref_cnt 1, evicting cached ones."""
        if num_blocks == 0:
            return []
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                if self.record_evictions:
                    self.evicted.append((block.block_id, block.block_hash))
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVBlock) -> None:
        removed = self.cached_blocks.pop(block.block_hash)  # type: ignore[arg-type]
        assert removed is block, "hash map points at another block"
        block.block_hash = None
        self.num_evictable_cached -= 1  # only ref-0 blocks are evicted
        self.stats.evictions += 1

    def uncache(self, block: KVBlock) -> None:
        """A cached-evictable block becomes free: its hash is dropped (its K/V was moved elsewhere) and it goes to
        the head of the free queue, reused before any cached block."""
        assert block.ref_cnt == 0 and block.block_hash is not None, f"block {block.block_id} is not cached-evictable"
        self.free_queue.remove(block)
        self._evict(block)
        self.free_queue.appendleft(block)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a ref-0 cached block leaves the free queue so it cannot be evicted."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                free_queue.remove(block)
                self.num_evictable_cached -= block.block_hash is not None
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full in-use block under its hash. False if the hash is already cached by another block.

        Keeping the existing mapping on a duplicate is safe: both blocks hold the same K/V, the request keeps
        using its own block (its K/V is being written there), and the duplicate goes back to the head of the
        free queue, unhashed, when released.
        """
        assert self.enable_caching
        assert block.ref_cnt > 0 and block.block_hash is None, f"block {block.block_id} cannot be cached"
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (that order becomes the LRU order)."""
        free_queue = self.free_queue
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    free_queue.appendleft(block)
                else:
                    free_queue.append(block)
                    self.num_evictable_cached += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while any block is in use, as in vLLM:
        in-use blocks may be hits for running requests and clearing them mid-flight would strand them."""
        if self.num_used_blocks > 0:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.num_evictable_cached = 0
        return True

    def check_invariants(self) -> None:
        """Every block in exactly one state, queue links mutual, hash map and blocks agree. O(num_blocks)."""
        queued = self.free_queue.check_links()
        queued_ids = {block.block_id for block in queued}
        assert len(queued_ids) == len(queued), "a block is queued twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_ids
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_queue={in_queue}"
            )
            assert in_queue == (block.prev_free is not None) == (block.next_free is not None)
            if block.block_hash is not None:
                assert self.enable_caching, "a block is hashed with prefix caching off"
                assert self.cached_blocks.get(block.block_hash) is block, f"block {block.block_id} hash not mapped"
        evictable = sum(1 for block in self.cached_blocks.values() if block.ref_cnt == 0)
        assert self.num_evictable_cached == evictable, f"{self.num_evictable_cached} evictable counted, {evictable} are"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"hash map entry for block {block.block_id} is stale"
            assert self.blocks[block.block_id] is block
