"""Property tests of the KV cache manager against small pools.

A stateful machine plays the scheduler (admit with cache lookup, chunked prefill, decode, preemption, finish,
abort, reset) with prompts drawn from a tiny alphabet around shared prefixes, so hits, duplicates and evictions
are frequent. It shadows the device: each block remembers which (salt, token prefix) its K/V was computed for,
so a hit on a block whose K/V belongs to another prefix (a stale or wrong hit) fails the test. Invariants are
checked after every step. The hybrid machine runs the same moves on a model whose layers mix full attention and
sliding windows: one block table per group, window groups giving back the blocks their window left.
"""

from __future__ import annotations

from hypothesis import event, given, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_requests import Req

from kvserve.cache import KVCacheManager
from kvserve.cache.kv_cache_manager import RELEASED_BLOCK
from kvserve.planner.kv_groups import first_needed_block

SHARED_PREFIXES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1] * 18, [2, 2, 0, 0] * 5)
SALTS = (None, None, None, "tenant-b")


prompts = st.builds(
    lambda prefix, cut, tail: (prefix[:cut] + tail) or [0],
    st.sampled_from(SHARED_PREFIXES),
    st.integers(0, 18),
    st.lists(st.integers(0, 2), max_size=10),
)


class PrefixCachingMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    num_blocks = 8  # small enough that evictions, failed allocations and preemptions are common
    block_size = 4
    hash_algo = "xxh3_128"
    group_windows: tuple[int | None, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(self.num_blocks, self.block_size, self.enable_prefix_caching, self.hash_algo,
                                      self.group_windows)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        # block id -> (salt, all tokens up to the end of the block) its K/V was last computed for.
        self.device_contents: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.num_requests = 0

    # ---- scheduler moves -----------------------------------------------------------------------------------

    @initialize(initial_prompts=st.lists(prompts, min_size=1, max_size=4))
    def start_with_waiting_requests(self, initial_prompts: list[list[int]]) -> None:
        for prompt in initial_prompts:
            self.add_request(prompt, None)

    @rule(prompt=prompts, salt=st.sampled_from(SALTS))
    def add_request(self, prompt: list[int], salt: str | None) -> None:
        self.num_requests += 1
        request = Req(f"req-{self.num_requests}", list(prompt), salt, len(prompt))
        self.waiting.append(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index")]
        hit_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)
        self._check_hit(request, hit_blocks, num_hit_tokens)
        event("admit: cache hit" if num_hit_tokens else "admit: no hit")
        num_remaining = len(request.all_token_ids) - num_hit_tokens
        num_new_tokens = data.draw(st.integers(1, num_remaining), label="prefill chunk")
        before = self._snapshot()
        stats = self.manager.stats
        queries_before, hits_before = stats.queries, stats.hits
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            event("admit: pool full")
            return
        # Exact accounting: each successful admission counts its tokens once, failed attempts never.
        counted = self.enable_prefix_caching
        assert stats.queries - queries_before == (len(request.all_token_ids) if counted else 0)
        assert stats.hits - hits_before == num_hit_tokens
        self.waiting.remove(request)
        self.running.append(request)
        request.num_computed_tokens = num_hit_tokens
        self._compute(request, num_new_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        request = self.running[data.draw(st.integers(0, len(self.running) - 1), label="running index")]
        num_remaining = len(request.all_token_ids) - request.num_computed_tokens
        if num_remaining > 0:
            num_new_tokens = data.draw(st.integers(1, num_remaining), label="prefill chunk")
        else:  # decode: the token sampled last step is scheduled now
            request.all_token_ids.append(data.draw(st.integers(0, 2), label="sampled token"))
            num_new_tokens = 1
        before = self._snapshot()
        if self.manager.allocate_slots(request, num_new_tokens, request.num_computed_tokens) is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            event("step: pool full, preempted")
            self._preempt(request)
            return
        self._compute(request, num_new_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(self.running[data.draw(st.integers(0, len(self.running) - 1), label="running index")])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = self.running.pop(data.draw(st.integers(0, len(self.running) - 1), label="running index"))
        self.manager.free(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        request = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index"))
        self.manager.free(request)  # holds nothing: must be a no-op

    @rule()
    def reset_prefix_cache(self) -> None:
        any_in_use = self.manager.pool.num_used_blocks > 0
        assert self.manager.reset_prefix_cache() == (not any_in_use)

    # ---- checks --------------------------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        self.manager.check_invariants()
        block_size = self.manager.block_size
        for request in self.running:
            # Exactly the blocks its computed tokens need: nothing over-allocated, nothing missing; a window group
            # holds none before the first block its last step's queries could see.
            num_needed_blocks = -(-request.num_computed_tokens // block_size)
            released = sum(first_needed_block(window, request.last_step_start, block_size)
                           for window in self.group_windows)
            assert self.manager.num_blocks_of(request.request_id) == num_needed_blocks * len(self.group_windows) - released
        for request in self.waiting:
            assert self.manager.num_blocks_of(request.request_id) == 0

    def teardown(self) -> None:
        for request in self.running:
            self.manager.free(request)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.usage == 0.0
        stats = self.manager.stats
        assert 0 <= stats.hits <= stats.queries
        event(f"evictions: {'some' if stats.evictions else 'none'}")
        # Steer generation towards the interesting regime: cache pressure.
        target(float(stats.evictions), label="evictions")

    # ---- helpers -------------------------------------------------------------------------------------------

    def _check_hit(self, request: Req, hit_blocks: tuple[list[int], ...], num_hit_tokens: int) -> None:
        block_size = self.manager.block_size
        assert num_hit_tokens <= len(request.all_token_ids) - 1, "at least one token must be computed"
        if not self.enable_prefix_caching or not num_hit_tokens:
            assert not any(hit_blocks)
            return
        for group, (window, hit) in enumerate(zip(self.group_windows, hit_blocks)):
            assert len(hit) * block_size == num_hit_tokens
            first = first_needed_block(window, num_hit_tokens, block_size)
            assert hit[:first] == [RELEASED_BLOCK] * first
            for block_index in range(first, len(hit)):
                self._check_contents(request, group, hit[block_index], block_index, (block_index + 1) * block_size)

    def _check_contents(self, request: Req, group: int, block_id: int, block_index: int, end: int) -> None:
        expected = (group, request.cache_salt or None, tuple(request.all_token_ids[:end]))
        assert self.device_contents.get(block_id) == expected, f"block {block_id} holds another prefix's K/V"

    def _compute(self, request: Req, num_new_tokens: int) -> None:
        """What the runner does: write K/V for the scheduled tokens into each group's blocks, after checking that
        every block the step's queries read (the whole context, or a window group's window) holds this request's
        K/V."""
        block_size = self.manager.block_size
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        tables = self.manager.get_block_tables(request.request_id)
        for group, (window, table) in enumerate(zip(self.group_windows, tables)):
            for block_index in range(first_needed_block(window, start, block_size), start // block_size):
                self._check_contents(request, group, table[block_index], block_index, (block_index + 1) * block_size)
            for block_index in range(start // block_size, -(-end // block_size)):
                block = self.manager.pool.blocks[table[block_index]]
                # Writes into a shared block would corrupt another request's K/V.
                assert block.ref_cnt == 1, f"writing into block {block.block_id} shared by {block.ref_cnt} requests"
                if start % block_size and block_index == start // block_size:  # a partial block continues
                    self._check_contents(request, group, block.block_id, block_index, start)
                block_end = min((block_index + 1) * block_size, end)
                computed_prefix = tuple(request.all_token_ids[:block_end])
                self.device_contents[block.block_id] = (group, request.cache_salt or None, computed_prefix)
        request.num_computed_tokens = end
        request.last_step_start = start

    def _preempt(self, request: Req) -> None:
        self.running.remove(request)
        self.manager.free(request)
        request.num_computed_tokens = request.last_step_start = 0
        self.waiting.insert(0, request)

    def _snapshot(self):
        manager = self.manager
        pool = manager.pool
        return (
            [block.block_id for block in pool.free_queue],
            [(block.ref_cnt, block.block_hash) for block in pool.blocks],
            dict(pool.cached_blocks),
            {request.request_id: [list(table) for table in manager.get_block_tables(request.request_id)]
             for request in self.running},
            (pool.stats.requests, pool.stats.queries, pool.stats.hits, pool.stats.evictions),
        )


class PrefixCachingOffMachine(PrefixCachingMachine):
    enable_prefix_caching = False


class SmallBlocksSha256Machine(PrefixCachingMachine):
    num_blocks = 12
    block_size = 2
    hash_algo = "sha256"


class HybridGroupsMachine(PrefixCachingMachine):
    """Two window groups (6 tokens, under two blocks of 4) around a full-attention one, as Gemma's layers are."""

    num_blocks = 20
    group_windows = (6, None, 6)


class HybridGroupsOffMachine(HybridGroupsMachine):
    enable_prefix_caching = False


_machine_settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCaching = PrefixCachingMachine.TestCase
TestPrefixCachingOff = PrefixCachingOffMachine.TestCase
TestSmallBlocksSha256 = SmallBlocksSha256Machine.TestCase
TestHybridGroups = HybridGroupsMachine.TestCase
TestHybridGroupsOff = HybridGroupsOffMachine.TestCase
for _case in (TestPrefixCaching, TestPrefixCachingOff, TestSmallBlocksSha256, TestHybridGroups, TestHybridGroupsOff):
    _case.settings = _machine_settings


@settings(max_examples=300, deadline=None)
@given(cached=prompts, probe=prompts, same_salt=st.booleans())
def test_hit_is_the_longest_common_full_block_prefix(cached: list[int], probe: list[int], same_salt: bool) -> None:
    block_size = 4
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    first = Req("first", list(cached), cache_salt="s")
    manager.allocate_slots(first, len(cached), 0)
    second = Req("second", list(probe), cache_salt="s" if same_salt else "other")
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    num_common = 0
    while num_common < min(len(cached), len(probe)) and cached[num_common] == probe[num_common]:
        num_common += 1
    expected_blocks = min(num_common // block_size, (len(probe) - 1) // block_size) if same_salt else 0
    assert num_hit_tokens == expected_blocks * block_size
    assert hit_blocks == (manager.get_block_table("first")[:expected_blocks],)
