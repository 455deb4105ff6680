"""Per-tier counters, shared by the host and disk tiers and read by the server's metrics."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

LOAD_BUCKETS = (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)  # seconds per block load: a host copy is ~1e-6, a disk read 1e-4


@dataclass(slots=True)
class TierStats:
    """Cumulative counters per tier (Prometheus `_total` counters), blocks and bytes."""

    queries: int = 0  # blocks looked up in this tier (after the tiers above missed)
    hits: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    loaded_bytes: int = 0
    skipped_slower_than_recompute: int = 0
    skipped_writes: int = 0  # blocks not stored: the tier's write queue was full
    # A histogram of block load latency: counts per LOAD_BUCKETS upper bound (the last is +inf), and the sum.
    load_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_seconds_sum: float = 0.0
    used_bytes: int = 0  # filled in by snapshot()
    capacity_bytes: int = 0

    def observe_load(self, seconds: float) -> None:
        self.load_seconds_sum += seconds
        self.load_bucket_counts[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1

    def snapshot(self, used_bytes: int, capacity_bytes: int) -> "TierStats":
        """A copy another thread may read while this tier keeps counting."""
        copy = dataclasses.replace(self, load_bucket_counts=list(self.load_bucket_counts))
        copy.used_bytes, copy.capacity_bytes = used_bytes, capacity_bytes
        return copy
