"""Which idempotent store writes this process made a moment ago, so it can skip repeating them: a session's TTL
refresh and a prompt's prefix record are the same write on every turn, and each costs a Redis round trip. This
is a cache of what was written, never state: forgetting it (a restart, another replica) only means the write is
made again."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MAX_ENTRIES = 100_000  # about 10 MB; past it the cache starts over


@dataclass(slots=True)
class RecentWrites:
    interval_s: float = 60.0
    written_at: dict[tuple[str, str], float] = field(default_factory=dict)
    clock: object = field(default=time.monotonic, repr=False)

    def due(self, key: str, value: str) -> bool:
        """True (and noted) unless this process wrote `value` for `key` within the interval."""
        now = self.clock()
        last = self.written_at.get((key, value))
        if last is not None and now - last < self.interval_s:
            return False
        if len(self.written_at) >= MAX_ENTRIES:
            self.written_at.clear()
        self.written_at[(key, value)] = now
        return True
