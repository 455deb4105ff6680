"""KVCacheManager on scripted workloads: exact hit counts, LRU eviction order, same-step hits, salts,
atomic allocation, shared-prefix memory, reset."""

from __future__ import annotations

import pytest

from cache_requests import Req

from kvserve.cache import KVCacheManager

BLOCK_SIZE = 16


def admit(manager: KVCacheManager, request: Req, num_new_tokens: int | None = None) -> int:
    """Admit like the scheduler: look up the cached prefix, allocate the rest (or a chunk). Returns hit tokens."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = len(request.all_token_ids) - num_hit_tokens
    assert manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks) is not None
    manager.check_invariants()
    return num_hit_tokens


def snapshot(manager: KVCacheManager):
    pool = manager.pool
    return (
        [block.block_id for block in pool.free_queue],
        [(block.ref_cnt, block.block_hash) for block in pool.blocks],
        dict(pool.cached_blocks),
        {rid: [(list(g.block_ids), g.num_cached_blocks) for g in rb.groups] for rid, rb in manager._requests.items()},
        (pool.stats.requests, pool.stats.queries, pool.stats.hits, pool.stats.evictions),
    )


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_two_requests_sharing_five_full_blocks_hit_80_tokens():
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    shared = tokens(1000, 5 * BLOCK_SIZE)
    first = Req("a", shared + tokens(1, 10))
    second = Req("b", shared + tokens(500, 7))
    assert admit(manager, first) == 0
    assert admit(manager, second) == 80
    assert manager.stats.queries == 90 + 87
    assert manager.stats.hits == 80
    assert manager.stats.requests == 2
    assert manager.get_block_table("b")[:5] == manager.get_block_table("a")[:5]
    assert manager.get_block_table("b")[5] != manager.get_block_table("a")[5]


def test_hit_is_capped_so_one_prompt_token_is_computed():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = tokens(0, 32)
    admit(manager, Req("a", prompt))
    # Both blocks are cached, but the last token must be computed for its logits: only 16 hit, not 32.
    assert manager.get_computed_blocks(Req("b", prompt)) == ((manager.get_block_table("a")[:1],), 16)
    assert manager.get_computed_blocks(Req("c", prompt + [7])) == ((manager.get_block_table("a")[:2],), 32)
    assert manager.get_computed_blocks(Req("d", prompt[:1])) == (([],), 0)


def test_lookup_alone_records_no_stats_and_failed_admissions_count_once():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    admit(manager, Req("a", tokens(0, 16)))  # fills the pool
    waiting = Req("b", tokens(100, 8))
    for _ in range(3):  # the scheduler retries every step while the pool is full
        hit_blocks, num_hit_tokens = manager.get_computed_blocks(waiting)
        assert manager.allocate_slots(waiting, 8 - num_hit_tokens, num_hit_tokens, hit_blocks) is None
    assert (manager.stats.requests, manager.stats.queries) == (1, 16)
    manager.free(Req("a", []))
    admit(manager, waiting)
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (2, 24, 0)


def test_same_step_hit_before_the_first_request_finishes():
    manager = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE)
    system_prompt = [(token * 7919) % 32000 for token in range(1000)]
    admit(manager, Req("a", system_prompt))
    # A's K/V is computed in this very step; B still shares every full block of it.
    assert admit(manager, Req("b", list(system_prompt))) == 992
    assert manager.pool.num_used_blocks == 62 + 1 + 1  # shared full blocks, then one partial block each


def test_same_step_hit_with_chunked_prefill_covers_only_scheduled_chunks():
    manager = KVCacheManager(num_blocks=256, block_size=BLOCK_SIZE)
    prompt = tokens(0, 1000)
    first = Req("a", prompt)
    admit(manager, first, num_new_tokens=512)
    # Only the first chunk's blocks will have K/V after this step.
    assert manager.get_computed_blocks(Req("b", list(prompt))) == ((manager.get_block_table("a"),), 512)
    assert manager.allocate_slots(first, 488, 512) is not None
    assert manager.get_computed_blocks(Req("c", list(prompt)))[1] == 992
    manager.check_invariants()


def test_parallel_sampling_siblings_share_the_prompt_blocks():
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    prompt = tokens(0, 100)  # 6 full blocks + 4 tokens
    hits = [admit(manager, Req(f"r-{index}", list(prompt))) for index in range(4)]
    assert hits == [0, 96, 96, 96]
    assert manager.pool.num_used_blocks == 6 + 4


def test_cache_salt_isolates_tenants():
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    prompt = tokens(0, 64)
    admit(manager, Req("a", prompt, cache_salt="tenant-a"))
    assert manager.get_computed_blocks(Req("b", prompt, cache_salt="tenant-b")) == (([],), 0)
    assert manager.get_computed_blocks(Req("c", prompt)) == (([],), 0)
    assert manager.get_computed_blocks(Req("d", prompt, cache_salt="tenant-a"))[1] == 48


def test_sha256_option():
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, hash_algo="sha256")
    first = Req("a", tokens(0, 40))
    admit(manager, first)
    assert all(len(block_hash) == 32 for block_hash in first.block_hashes)
    assert admit(manager, Req("b", tokens(0, 40))) == 32
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="crc32")


def test_allocate_returns_none_without_side_effects_when_full():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    admit(manager, Req("a", tokens(0, 20)))  # 5 blocks
    manager.free(Req("a", []))  # 5 cached-evictable + 3 free
    admit(manager, Req("b", tokens(100, 12)))  # takes 3 free-queue-head blocks
    before = snapshot(manager)
    too_big = Req("c", tokens(200, 24))  # needs 6 > 5
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(too_big)
    assert manager.allocate_slots(too_big, 24, num_hit_tokens, hit_blocks) is None
    running = Req("b", tokens(100, 12) + tokens(0, 40))
    assert manager.allocate_slots(running, 40, 12) is None  # a running request growing past the pool
    assert snapshot(manager) == before
    manager.check_invariants()


def test_touched_cached_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    prefix = tokens(0, 12)
    admit(manager, Req("a", prefix))
    manager.free(Req("a", []))  # 3 cached-evictable + 1 free: 4 "free"
    longer = Req("b", prefix + tokens(50, 8))  # 3 hit blocks + 2 new = 5 > 4, though only 2 are "new"
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(longer)
    assert num_hit_tokens == 12
    before = snapshot(manager)
    assert manager.allocate_slots(longer, 8, num_hit_tokens, hit_blocks) is None
    assert snapshot(manager) == before
    fits = Req("c", prefix + tokens(50, 4))  # 3 hit blocks + 1 new = 4
    assert admit(manager, fits) == 12
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_hit_on_an_in_use_block_needs_no_free_block():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    admit(manager, Req("a", tokens(0, 13)))  # 4 blocks, pool full
    assert manager.num_free_blocks == 0
    sibling = Req("b", tokens(0, 12))
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(sibling)
    assert num_hit_tokens == 8
    # 2 shared in-use blocks, 1 new block needed, none free.
    assert manager.allocate_slots(sibling, 4, num_hit_tokens, hit_blocks) is None


def test_lru_evicts_the_suffix_first_and_older_requests_first():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    older, newer = Req("older", tokens(0, 12)), Req("newer", tokens(100, 8))
    admit(manager, older)  # blocks 0, 1, 2
    admit(manager, newer)  # blocks 3, 4
    manager.free(older)
    manager.free(newer)
    assert [block.block_id for block in manager.pool.free_queue] == [5, 6, 7, 2, 1, 0, 4, 3]

    def hit_tokens(request: Req) -> int:
        return manager.get_computed_blocks(Req("probe", request.all_token_ids + [1]))[1]

    admit(manager, Req("x", tokens(1000, 16)))  # 3 free blocks, then evicts older's last block
    assert manager.stats.evictions == 1
    assert (hit_tokens(older), hit_tokens(newer)) == (8, 8)
    admit(manager, Req("y", tokens(2000, 8)))  # evicts the rest of older, prefix last
    assert manager.stats.evictions == 3
    assert (hit_tokens(older), hit_tokens(newer)) == (0, 8)


def test_a_hit_refreshes_recency():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    first, second = Req("first", tokens(0, 4)), Req("second", tokens(100, 4))
    for request in (first, second):
        admit(manager, request)
        manager.free(request)
    again = Req("again", tokens(0, 5))
    assert admit(manager, again) == 4  # first's block is used again...
    manager.free(again)  # ...and goes back to the tail, behind second's block
    admit(manager, Req("z", tokens(500, 12)))  # 2 free + evict 1 cached: second's
    assert manager.get_computed_blocks(Req("p", tokens(100, 5)))[1] == 0
    assert manager.get_computed_blocks(Req("q", tokens(0, 5)))[1] == 4


def test_decode_blocks_become_hittable_as_they_fill():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = Req("a", tokens(0, 6))
    admit(manager, request)
    assert manager.num_cached_blocks == 1
    num_computed = 6
    for generated in (60, 61, 62):  # the 8th token fills block 1
        request.all_token_ids.append(generated)
        assert manager.allocate_slots(request, 1, num_computed) is not None
        num_computed += 1
    assert manager.num_cached_blocks == 2
    follow_up = Req("b", list(request.all_token_ids) + [1, 2])  # the next turn of the conversation
    assert manager.get_computed_blocks(follow_up)[1] == 8


def test_preempted_request_is_readmitted_with_its_generated_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = Req("a", tokens(0, 8))
    admit(manager, request)
    for generated in range(5):
        request.all_token_ids.append(100 + generated)
        manager.allocate_slots(request, 1, len(request.all_token_ids) - 1)
    hashes_before = list(request.block_hashes)
    manager.free(request)  # preempted: recompute later
    assert manager.num_blocks_of("a") == 0
    assert admit(manager, request) == 12  # 13 tokens: three full blocks, the last token recomputed
    assert request.block_hashes[: len(hashes_before)] == hashes_before
    assert manager.stats.queries == 8 + 13


def test_concurrent_duplicates_keep_the_first_mapping():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first, second = Req("a", tokens(0, 9)), Req("b", tokens(0, 9))
    # Both looked up before either allocated (e.g. an admission policy that ranks before allocating).
    lookups = [manager.get_computed_blocks(request) for request in (first, second)]
    assert lookups == [(([],), 0), (([],), 0)]
    for request in (first, second):
        assert manager.allocate_slots(request, 9, 0) is not None
    manager.check_invariants()
    first_blocks = manager.get_block_table("a")
    assert manager.get_computed_blocks(Req("c", tokens(0, 9)))[0] == (first_blocks[:2],)
    manager.free(second)
    manager.free(first)
    manager.check_invariants()
    assert manager.num_cached_blocks == 2
    assert manager.num_free_blocks == 16


def test_n_requests_sharing_a_prefix_hold_the_shared_blocks_once():
    manager = KVCacheManager(num_blocks=128, block_size=BLOCK_SIZE)
    prefix_len, num_requests = 200, 8  # 12 full shared blocks; the 13th block is partly each request's own
    prefix = tokens(0, prefix_len)
    for index in range(num_requests):
        admit(manager, Req(f"r-{index}", prefix + tokens(10_000 * (index + 1), 40)))
    num_shared = prefix_len // BLOCK_SIZE
    num_own = -(-(prefix_len + 40) // BLOCK_SIZE) - num_shared
    assert manager.pool.num_used_blocks == num_shared + num_requests * num_own
    assert manager.stats.hits == (num_requests - 1) * num_shared * BLOCK_SIZE


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    running = Req("a", tokens(0, 9))
    admit(manager, running)
    assert manager.reset_prefix_cache() is False
    assert manager.num_cached_blocks == 2
    manager.free(running)
    assert manager.reset_prefix_cache() is True
    assert manager.num_cached_blocks == 0
    assert manager.get_computed_blocks(Req("b", tokens(0, 9))) == (([],), 0)
    manager.check_invariants()


def test_caching_off_hashes_nothing_and_counts_nothing():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = Req("a", tokens(0, 9))
    admit(manager, first)
    assert admit(manager, Req("b", tokens(0, 9))) == 0
    assert first.block_hashes == [] and manager.num_cached_blocks == 0
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (0, 0, 0)
    assert manager.pool.num_used_blocks == 6


def test_block_tables_views_and_freeing_everything():
    manager = KVCacheManager(num_blocks=32, block_size=4)
    requests = [Req(f"r-{index}", tokens(index % 3, 10 + index)) for index in range(6)]
    for request in requests:
        admit(manager, request)
        assert manager.num_blocks_of(request.request_id) == -(-len(request.all_token_ids) // 4)
        assert len(manager.get_block_table(request.request_id)) == manager.num_blocks_of(request.request_id)
    assert manager.get_block_table("unknown") == [] and manager.num_blocks_of("unknown") == 0
    assert 0 < manager.usage < 1
    for request in requests:
        manager.free(request)
    manager.free(requests[0])  # freeing twice (abort after finish) is harmless
    manager.check_invariants()
    assert manager.num_free_blocks == 32 and manager.usage == 0.0
