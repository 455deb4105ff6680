"""What a KV tier below the pool is, to the coordinator (kv_tiers.py): a store of block payloads keyed by block
hash, driven in batches. The host and disk tiers implement it; KVTiers knows no other.

A payload is a block in the pool's own format as flat bytes (block_copier.py), so a tier never sees formats.
`contains` answers per hash, not with a count of leading hits: a prefix's chain may continue from one tier
into the next (its first blocks in host memory, the older ones on disk), so the coordinator merges the
answers of every tier position by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.cache.block_hash import BlockHash
from kvserve.cache.tier_stats import TierStats

Evicted = list[tuple[BlockHash, torch.Tensor]]


class Tier(Protocol):
    name: str  # "host", "disk": the label of its metrics and of the tokens a request loaded from it
    persistent: bool  # outlives the process: shutdown saves into it what the pool and the tiers above hold
    capacity_bytes: int
    used_bytes: int
    read_bytes_per_s: float  # what a load from it is estimated at, against the prefill it would save
    stats: TierStats  # counted by the coordinator, which sees queries, hits and offloads

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, whether this tier holds its block."""
        ...

    def put(self, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> Evicted:
        """Stores each payload under its hash (a hash already held is only made most recent). Returns what it
        evicted to make room, oldest first, for the tier below; a bottom tier drops those and returns []."""
        ...

    def get(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Each hash's payload, None where the block is missing or turned out unreadable (then forgotten)."""
        ...

    def hashes(self) -> list[BlockHash]:
        """Every hash it holds, least recently used first (what shutdown saves to a persistent tier)."""
        ...

    def flush(self, deadline: float | None = None) -> bool:
        """Waits until what `put` accepted is stored, or until `deadline` (time.monotonic()); True when all
        is. Shutdown saves in batches and flushes each before reading the next, so memory stays bounded."""
        ...

    def close(self, deadline: float | None = None) -> None:
        """Stores what is still pending until `deadline`, drops the rest, and releases what it holds."""
        ...
