"""Layers grouped by what their KV cache keeps: the pool's layout for models that mix attention kinds.

A model whose layers all attend the same way (every layer over the whole context, or every layer over one
sliding window) is one group, and a pool block holds one block of tokens for every layer, as before.

A model that mixes them (Gemma 2/3: a sliding window on most layers, full attention on the rest) keeps per request
one block table per group. The groups have the same number of layers (`num_slots`), so one pool block holds one
group's K/V for `num_slots` layers whichever group holds it, and the pool stays one fungible set of blocks: a
full-attention group takes a block for every `block_size` tokens, a window group only for the tokens its window
still covers, and frees the ones that fell out of it. Layers of one kind fill groups in order; the last group of a
kind may have empty slots (their bytes are counted, as the pool allocates them). vLLM's hybrid KV cache manager
groups layers the same way.

The block counts here are THE formula for what a request holds; the engine's cache manager frees blocks by the
same rule (`first_needed_block`), so `kvserve plan`, the start-up log and the running engine agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.planner.units import ceil_div


@dataclass(slots=True, frozen=True)
class KVCacheGroup:
    window: int | None  # the layers' sliding window; None: full attention
    layers: tuple[int, ...]  # model layer indices; the k-th uses the pool's storage slot k


@dataclass(slots=True, frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    num_slots: int  # layers whose K/V one pool block holds

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def place(self, layer: int) -> tuple[int, int]:
        """(group, storage slot) of a model layer."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV cache group")

    def blocks_per_request(self, context_len: int, block_size: int) -> int:
        """Pool blocks one request holds with `context_len` tokens in the cache, summed over the groups."""
        return sum(group_blocks(group.window, context_len, block_size) for group in self.groups)

    def peak_blocks_per_request(self, context_len: int, block_size: int, chunk_len: int) -> int:
        """The most blocks one request of `context_len` tokens holds at once, prefilled `chunk_len` tokens a
        step: a window group holds the window behind a chunk and the chunk itself."""
        return sum(group_peak_blocks(group.window, context_len, block_size, chunk_len) for group in self.groups)

    def longest_context(self, num_blocks: int, block_size: int, chunk_len: int, limit: int) -> int:
        """The longest request (at most `limit` tokens) whose peak fits in `num_blocks`."""
        if self.peak_blocks_per_request(limit, block_size, chunk_len) <= num_blocks:
            return limit
        fits, too_long = 0, limit  # peak blocks grow with the context: bisect
        while too_long - fits > 1:
            middle = (fits + too_long) // 2
            if self.peak_blocks_per_request(middle, block_size, chunk_len) <= num_blocks:
                fits = middle
            else:
                too_long = middle
        return fits


def first_needed_block(window: int | None, first_query_position: int, block_size: int) -> int:
    """The first block a window group still reads when its next query is at `first_query_position`: a query at
    position p sees keys p - window + 1 .. p (transformers' sliding window). Blocks before it are never read
    again by that request."""
    if window is None:
        return 0
    return max(0, first_query_position - window + 1) // block_size


def group_blocks(window: int | None, context_len: int, block_size: int) -> int:
    """Blocks one group holds for a request with `context_len` tokens cached, its last query at context_len - 1."""
    held = ceil_div(context_len, block_size)
    return held - first_needed_block(window, context_len - 1, block_size) if context_len else 0


def group_peak_blocks(window: int | None, context_len: int, block_size: int, chunk_len: int) -> int:
    """The most blocks a group holds while a request reaches `context_len` tokens, `chunk_len` new tokens a step."""
    if window is None or context_len <= chunk_len:
        return ceil_div(context_len, block_size)
    # A chunk's first query at p needs blocks from first_needed_block(p) through the chunk's end, p + chunk - 1.
    span = window - 1 + chunk_len
    return min(ceil_div(context_len, block_size), ceil_div(span - 1, block_size) + 1)


def kv_cache_layout(layer_windows: Sequence[int | None]) -> KVCacheLayout:
    """Groups for layers with these windows (None: full attention), in layer order within each kind."""
    assert layer_windows, "a model has layers"
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    num_slots = min(len(layers) for layers in kinds.values())
    groups = tuple(KVCacheGroup(window, tuple(layers[start:start + num_slots]))
                   for window, layers in kinds.items() for start in range(0, len(layers), num_slots))
    return KVCacheLayout(groups, num_slots)
