"""The host tier (`--kv-offloading-size` GiB): payloads in host memory, least recently used out first, to the
tier below. On CPU the pool already is host memory, so an offload to it is one memcpy of the evicted blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvserve.cache.block_hash import BlockHash
from kvserve.cache.storage.tier import Evicted
from kvserve.cache.tier_stats import TierStats

DEFAULT_HOST_BYTES_PER_S = 5e9  # what a load from host memory is estimated at (a copy; not measured)


class HostTier:
    name = "host"
    persistent = False

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.read_bytes_per_s = DEFAULT_HOST_BYTES_PER_S
        self.entries: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self.stats = TierStats()

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [block_hash in self.entries for block_hash in hashes]

    def put(self, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> Evicted:
        evicted: Evicted = []
        for block_hash, payload in zip(hashes, payloads):
            if block_hash in self.entries:
                self.entries.move_to_end(block_hash)
                continue
            self.entries[block_hash] = payload
            self.used_bytes += payload.numel()
            while self.used_bytes > self.capacity_bytes and self.entries:
                old_hash, old = self.entries.popitem(last=False)
                self.used_bytes -= old.numel()
                evicted.append((old_hash, old))
        return evicted

    def get(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        payloads = []
        for block_hash in hashes:
            payload = self.entries.get(block_hash)
            if payload is not None:
                self.entries.move_to_end(block_hash)
            payloads.append(payload)
        return payloads

    def hashes(self) -> list[BlockHash]:
        return list(self.entries)

    def flush(self, deadline: float | None = None) -> bool:
        return True  # a put is done when it returns

    def close(self, deadline: float | None = None) -> None:
        self.entries.clear()
        self.used_bytes = 0
