"""KV tiers below the pool: host memory, then disk, each LRU, keyed by the block hash chain.

A cached block evicted from the pool goes to the host tier (`--kv-offloading-size` GiB) as its payload
(block_copier.py: the pool's own bytes, quantized formats included); what the host tier evicts goes to the disk
tier (`--kv-disk-path`, `--kv-disk-size` GiB). At admission the manager continues a request's pool hit chain
into the tiers, block by block, and loads the hits back into pool blocks, where they are ordinary cached blocks.

On CPU the pool already is host memory, so offloading to the host tier is a memcpy of the evicted blocks done
in the step that evicts them (before the forward overwrites them), batched per allocation; disk writes run on
a worker thread. A load is skipped when its estimated time exceeds the prefill it saves.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from kvserve.cache.block_copier import BlockCopier
from kvserve.cache.block_hash import BlockHash
from kvserve.cache.disk_tier import DiskTier
from kvserve.cache.tier_stats import TierStats
from kvserve.cache.transfers import OFFLOAD, FromOffload, Transfer

logger = logging.getLogger("kvserve.cache")

# What a prefill costs before the engine has measured one (tokens/s); the engine updates it (see note_prefill).
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
DEFAULT_HOST_BYTES_PER_S = 5e9


class HostTier:
    """Payloads in host memory up to `capacity_bytes`, least recently used first out (to `spill`)."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.entries: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self.stats = TierStats()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> list[tuple[BlockHash, torch.Tensor]]:
        """Stores a payload; returns what it evicted to make room (for the tier below)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return []
        self.entries[block_hash] = payload
        self.used_bytes += payload.numel()
        evicted = []
        while self.used_bytes > self.capacity_bytes and self.entries:
            old_hash, old = self.entries.popitem(last=False)
            self.used_bytes -= old.numel()
            evicted.append((old_hash, old))
        return evicted

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        payload = self.entries.get(block_hash)
        if payload is not None:
            self.entries.move_to_end(block_hash)
        return payload


class KVTiers:
    """The tiers of one pool: offload on eviction, lookup and load at admission."""

    def __init__(self, copier: BlockCopier, host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None
        self.copier = copier
        self.host = host
        self.disk = disk
        self.tiers = [tier for tier in (host, disk) if tier is not None]  # top first
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S
        self.host_bytes_per_s = DEFAULT_HOST_BYTES_PER_S

    def apply(self, transfers: list[Transfer]) -> None:
        """Does the block copies the cache manager ordered (KVCacheManager.take_transfers), in order."""
        for transfer in transfers:
            if transfer.kind == OFFLOAD:
                self.offload(transfer.block_ids, transfer.items, transfer)
            else:
                self.copier.write(transfer.block_ids, [source.order.payloads[source.index]
                                                       if isinstance(source, FromOffload) else source
                                                       for source in transfer.items])

    def offload(self, block_ids: list[int], block_hashes: list[BlockHash], order: Transfer | None = None) -> None:
        """Copies evicted cached blocks (still intact) to the first tier; what it evicts goes further down. The
        blocks a later load of the same step takes (order.kept) are read for it too, into order.payloads."""
        kept = order.kept if order is not None else ()
        wanted = [i for i, block_hash in enumerate(block_hashes) if i in kept or not self.holds(block_hash)]
        if not wanted:
            return
        payloads = self.copier.read([block_ids[i] for i in wanted])
        for i, payload in zip(wanted, payloads):
            if i in kept:
                order.payloads[i] = payload
            if not self.holds(block_hashes[i]):
                self._store(block_hashes[i], payload)

    def _store(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        first = self.tiers[0]
        first.stats.offloaded_blocks += 1
        first.stats.offloaded_bytes += payload.numel()
        if first is self.disk:
            self.disk.put(block_hash, payload)
            return
        for old_hash, old in self.host.put(block_hash, payload):
            if self.disk is not None:
                self.disk.stats.offloaded_blocks += 1
                self.disk.stats.offloaded_bytes += old.numel()
                self.disk.put(old_hash, old)

    def snapshot(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats.snapshot(tier.used_bytes, tier.capacity_bytes) for tier in self.tiers}

    def holds(self, block_hash: BlockHash) -> bool:
        return any(block_hash in tier for tier in self.tiers)

    def find(self, block_hashes: list[BlockHash], num_tokens_per_block: int
             ) -> list[tuple[BlockHash, torch.Tensor, str]]:
        """(hash, payload, tier name) of the longest run of `block_hashes` (in order) the tiers hold, read now;
        stops at the first miss, and before the disk when reading it would take longer than recomputing."""
        found: list[tuple[BlockHash, torch.Tensor, str]] = []
        for block_hash in block_hashes:
            hit = self._find_one(block_hash, num_tokens_per_block)
            if hit is None:
                break
            found.append((block_hash, *hit))
        return found

    def _find_one(self, block_hash: BlockHash, num_tokens: int) -> tuple[torch.Tensor, str] | None:
        for tier in self.tiers:
            tier.stats.queries += 1
            if block_hash not in tier:
                continue
            if not self._worth_loading(tier, num_tokens):
                tier.stats.skipped_slower_than_recompute += 1
                return None
            started = time.perf_counter()
            payload = tier.get(block_hash)
            if payload is None:  # a disk file that turned out corrupt or vanished: recompute
                continue
            tier.stats.hits += 1
            tier.stats.loaded_bytes += payload.numel()
            tier.stats.observe_load(time.perf_counter() - started)
            return payload, tier.name
        return None

    def _worth_loading(self, tier, num_tokens: int) -> bool:
        bytes_per_s = self.host_bytes_per_s if tier is self.host else tier.read_bytes_per_s
        load_s = self.copier.payload_bytes / bytes_per_s
        return load_s <= num_tokens / self.prefill_tokens_per_s

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine's measured prefill speed (an exponential average), what a load is compared against."""
        if num_tokens >= 64 and seconds > 0:
            self.prefill_tokens_per_s = 0.8 * self.prefill_tokens_per_s + 0.2 * (num_tokens / seconds)

    def close(self, pool_block_ids: list[int], pool_block_hashes: list[BlockHash]) -> None:
        """At shutdown, with a disk tier: what the pool and the host tier still hold goes to disk too (the
        blocks a restarted server will be asked for are mostly the recent ones), then the writer drains."""
        if self.disk is None:
            return
        for block_hash, payload in zip(pool_block_hashes, self.copier.read(pool_block_ids)):
            self.disk.put(block_hash, payload)
        if self.host is not None:
            for block_hash, payload in self.host.entries.items():
                self.disk.put(block_hash, payload)
        self.disk.close()
