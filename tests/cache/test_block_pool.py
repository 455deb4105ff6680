"""Block pool building blocks: the O(1) free queue, block states and ref counts, and block hashing."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvserve.cache import BlockHasher, BlockPool, FreeBlockQueue, KVBlock, get_hash_function


def make_blocks(num_blocks: int) -> list[KVBlock]:
    return [KVBlock(block_id) for block_id in range(num_blocks)]


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


# ---- FreeBlockQueue ----------------------------------------------------------------------------------------


def test_queue_starts_in_block_id_order():
    queue = FreeBlockQueue(make_blocks(5))
    assert len(queue) == 5
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert ids(queue.check_links()) == [0, 1, 2, 3, 4]


def test_queue_popleft_append_appendleft_remove_keep_order():
    blocks = make_blocks(5)
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    assert blocks[0] not in queue
    queue.remove(blocks[2])  # from the middle
    assert ids(queue) == [1, 3, 4]
    queue.append(blocks[2])  # tail: evicted last
    queue.appendleft(blocks[0])  # head: reused first
    assert ids(queue) == [0, 1, 3, 4, 2]
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[2])  # the tail
    assert ids(queue) == [1, 3, 4]
    assert len(queue) == 3
    queue.check_links()


def test_queue_popleft_n_takes_the_head_run():
    blocks = make_blocks(6)
    queue = FreeBlockQueue(blocks)
    assert ids(queue.popleft_n(4)) == [0, 1, 2, 3]
    assert ids(queue) == [4, 5]
    assert queue.popleft_n(0) == []
    assert all(block.prev_free is None and block.next_free is None for block in blocks[:4])
    assert ids(queue.popleft_n(2)) == [4, 5]
    assert len(queue) == 0
    queue.check_links()


def test_queue_empty_and_misuse_raise():
    blocks = make_blocks(2)
    queue = FreeBlockQueue(blocks)
    with pytest.raises(IndexError):
        queue.popleft_n(3)
    queue.popleft_n(2)
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])  # not queued
    queue.append(blocks[0])
    with pytest.raises(AssertionError):
        queue.append(blocks[0])  # queued twice


def test_block_repr_does_not_walk_the_list():
    blocks = make_blocks(3)
    FreeBlockQueue(blocks)
    assert "prev_free" not in repr(blocks[1])


# ---- BlockPool -------------------------------------------------------------------------------------------


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants()


def test_freed_unhashed_blocks_go_to_the_head_hashed_to_the_tail():
    pool = BlockPool(num_blocks=4)
    hashed, plain = pool.get_new_blocks(2)
    assert pool.cache_block(hashed, b"h" * 16)
    pool.free_blocks([hashed, plain])
    assert ids(pool.free_queue) == [plain.block_id, 2, 3, hashed.block_id]
    pool.check_invariants()


def test_eviction_drops_the_hash_and_counts():
    pool = BlockPool(num_blocks=2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"a" * 16)
    pool.cache_block(second, b"b" * 16)
    pool.free_blocks([first, second])
    assert pool.num_cached_blocks == 2
    (reused,) = pool.get_new_blocks(1)
    assert reused is first and reused.block_hash is None
    assert pool.get_cached_block(b"a" * 16) is None
    assert pool.get_cached_block(b"b" * 16) is second
    assert pool.stats.evictions == 1
    pool.check_invariants()


def test_touch_takes_a_cached_block_out_of_the_queue_and_shares_it():
    pool = BlockPool(num_blocks=3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"x" * 16)
    pool.free_blocks([block])
    assert block in pool.free_queue
    pool.touch([block])
    assert block not in pool.free_queue and block.ref_cnt == 1
    pool.touch([block])  # a second request hits it while in use
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert block not in pool.free_queue
    pool.free_blocks([block])
    assert block in pool.free_queue and block.block_hash == b"x" * 16
    pool.check_invariants()


def test_cache_block_keeps_the_first_mapping_on_duplicates():
    pool = BlockPool(num_blocks=2)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_block(first, b"same" * 4)
    assert not pool.cache_block(second, b"same" * 4)
    assert second.block_hash is None and pool.get_cached_block(b"same" * 4) is first
    pool.free_blocks([second, first])
    assert ids(pool.free_queue) == [second.block_id, first.block_id]  # duplicate reused first
    pool.check_invariants()


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=1)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(num_blocks=2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"a" * 16)
    pool.free_blocks([first])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"a" * 16) is first  # nothing changed
    pool.free_blocks([second])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and first.block_hash is None
    assert pool.num_free_blocks == 2
    pool.check_invariants()


# ---- block hashing -----------------------------------------------------------------------------------------


def test_hash_encoding_is_pinned():
    # Offload tiers key blocks by hash across restarts: changing the encoding must be a deliberate act.
    seed = hashlib.sha256(b"kvserve/prefix-cache/v1").digest()
    expected_first = hashlib.sha256(seed + struct.pack("<4q", 1, 2, 3, 4)).digest()
    expected_second = hashlib.sha256(expected_first + struct.pack("<4q", 5, 6, 7, 8)).digest()
    hashes: list[bytes] = []
    BlockHasher(4, "sha256").extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], None, 2)
    assert hashes == [expected_first, expected_second]

    xxh_hashes: list[bytes] = []
    BlockHasher(4).extend_block_hashes(xxh_hashes, [1, 2, 3, 4, 5, 6, 7, 8], None, 2)
    assert [h.hex() for h in xxh_hashes] == ["2e63772864f2742bf5e36d2ab6b0a7a9", "af9926dba2a5fe788e1fc0428c4006e7"]


def test_hash_sizes_and_unknown_algo():
    assert len(get_hash_function("xxh3_128")(b"x")) == 16
    assert len(get_hash_function("sha256")(b"x")) == 32
    with pytest.raises(ValueError, match="sha256"):
        get_hash_function("md5")


def test_hashes_are_chained_and_incremental():
    hasher = BlockHasher(2)
    tokens = [1, 2, 3, 4, 5, 6]
    all_at_once: list[bytes] = []
    hasher.extend_block_hashes(all_at_once, tokens, None, 3)
    incremental: list[bytes] = []
    for num_blocks in (1, 1, 2, 3, 3):
        hasher.extend_block_hashes(incremental, tokens, None, num_blocks)
    assert incremental == all_at_once
    # Same second block after a different first block: different hash (the parent is part of it).
    other: list[bytes] = []
    hasher.extend_block_hashes(other, [9, 9, 3, 4], None, 2)
    assert other[1] != all_at_once[1]
    with pytest.raises(AssertionError):
        hasher.extend_block_hashes([], [1, 2, 3], None, 2)  # block 2 is not full


def test_cache_salt_changes_every_block():
    hasher = BlockHasher(2)
    tokens = [1, 2, 3, 4]
    by_salt = {}
    for salt in (None, "", "tenant-a", "tenant-b"):
        hashes: list[bytes] = []
        hasher.extend_block_hashes(hashes, tokens, salt, 2)
        by_salt[salt] = hashes
    assert by_salt[None] == by_salt[""]  # no salt and an empty salt are the same tenant
    for salt_a, salt_b in ((None, "tenant-a"), ("tenant-a", "tenant-b")):
        assert all(a != b for a, b in zip(by_salt[salt_a], by_salt[salt_b]))
