"""The idle-session policy (--kv-idle-offload-seconds): a session's blocks leave the pool for the KV tiers once
it has been idle that long, instead of waiting to be evicted (the seed's "30 minutes idle" rule, without losing
the cache: its next turn loads them back).

A session is what a request names with a session id (OpenAI's `user`, or the `X-Session-ID` header the gateway
sets); its blocks are the cached full blocks of its latest finished request (the whole conversation so far).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvserve.cache.block_hash import BlockHash


class IdleSessions:
    def __init__(self, idle_seconds: float) -> None:
        self.idle_seconds = idle_seconds
        self._last_seen: OrderedDict[str, tuple[float, list[BlockHash]]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._last_seen)

    def note(self, session_id: str, block_hashes: list[BlockHash], now: float | None = None) -> None:
        """A request of the session finished: the session is active now, and these are its blocks."""
        self._last_seen.pop(session_id, None)
        self._last_seen[session_id] = (time.monotonic() if now is None else now, list(block_hashes))

    def due(self, now: float | None = None) -> list[list[BlockHash]]:
        """The blocks of every session idle for idle_seconds by now; those sessions are forgotten."""
        now = time.monotonic() if now is None else now
        expired = []
        while self._last_seen:
            session_id, (seen, hashes) = next(iter(self._last_seen.items()))
            if now - seen < self.idle_seconds:
                break
            del self._last_seen[session_id]
            expired.append(hashes)
        return expired

    def seconds_to_next(self, now: float | None = None) -> float | None:
        """How long until the next session falls due (0 if one is due); None when none is tracked."""
        if not self._last_seen:
            return None
        now = time.monotonic() if now is None else now
        seen, _ = next(iter(self._last_seen.values()))
        return max(0.0, seen + self.idle_seconds - now)
