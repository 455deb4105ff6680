"""Keys this process has verified, so a completion need not read the key's record in a round trip of its own
before the rest of its state: the record is read again in the request's one round trip (request_state) and
checked again there, so a revoked key (or changed limits) takes effect on its very next request. What the cache
spares is only the separate read; what it guards is the rate-limit counter, which is counted in that same round
trip and so must never be touched for a key that has not proved itself once (a key id is not a secret).

Entries are keyed by a digest of the presented key, not the key, and the cache starts over when full."""

from __future__ import annotations

import hashlib

from kvserve.gateway.keys import KeyRecord

MAX_KEYS = 10_000


class VerifiedKeys:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.records: dict[bytes, KeyRecord] = {}

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode(), digest_size=16).digest()

    def get(self, key: str) -> KeyRecord | None:
        return self.records.get(self._digest(key))

    def put(self, key: str, record: KeyRecord) -> None:
        if len(self.records) >= self.max_keys:
            self.records.clear()
        self.records[self._digest(key)] = record

    def forget(self, key: str) -> None:
        self.records.pop(self._digest(key), None)
