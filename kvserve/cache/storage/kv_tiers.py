"""KV tiers below the pool, top first (host memory, then disk), each LRU, keyed by the block hash chain.

A cached block evicted from the pool goes to the first tier as its payload (block_copier.py: the pool's own
bytes, quantized formats included); what a tier evicts goes to the one below it. At admission the manager
continues a request's pool hit chain into the tiers, block by block, and loads the hits back into pool blocks,
where they are ordinary cached blocks. The tiers are reached through the Tier protocol (tier.py) alone.

On CPU the pool already is host memory, so offloading to the host tier is a memcpy of the evicted blocks done
in the step that evicts them (before the forward overwrites them), batched per allocation; disk writes run on
a worker thread. A load is skipped when its estimated time exceeds the prefill it saves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import torch

from kvserve.cache.block_hash import BlockHash
from kvserve.cache.storage.block_copier import BlockCopier
from kvserve.cache.storage.tier import Tier
from kvserve.cache.tier_stats import TierStats
from kvserve.cache.transfers import OFFLOAD, FromOffload, Transfer

logger = logging.getLogger("kvserve.cache")

# What a prefill costs before the engine has measured one (tokens/s); the engine updates it (see note_prefill).
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
# Shutdown saves the pool to a persistent tier in batches of at most this many payload bytes, each written
# before the next is read: what saving holds in memory does not grow with the pool.
SAVE_BATCH_BYTES = 64 * 2**20


class KVTiers:
    """The tiers of one pool: offload on eviction, lookup and load at admission, saving at shutdown."""

    def __init__(self, copier: BlockCopier, tiers: Sequence[Tier]) -> None:
        assert tiers, "KVTiers needs a tier"
        self.copier = copier
        self.tiers = list(tiers)  # top first
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S
        self.save_batch_bytes = SAVE_BATCH_BYTES

    def tier(self, name: str) -> Tier | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

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
        held = self._held(block_hashes)
        wanted = [i for i, is_held in enumerate(held) if i in kept or not is_held]
        if not wanted:
            return
        payloads = self.copier.read([block_ids[i] for i in wanted])
        new_hashes, new_payloads = [], []
        for i, payload in zip(wanted, payloads):
            if i in kept:
                order.payloads[i] = payload
            if not held[i]:
                new_hashes.append(block_hashes[i])
                new_payloads.append(payload)
        self._store(new_hashes, new_payloads)

    def _store(self, hashes: list[BlockHash], payloads: list[torch.Tensor]) -> None:
        """Puts the blocks in the first tier, and what each tier evicts in the one below."""
        for tier in self.tiers:
            if not hashes:
                return
            tier.stats.offloaded_blocks += len(hashes)
            tier.stats.offloaded_bytes += sum(payload.numel() for payload in payloads)
            evicted = tier.put(hashes, payloads)
            hashes, payloads = [block_hash for block_hash, _ in evicted], [payload for _, payload in evicted]

    def _held(self, block_hashes: list[BlockHash]) -> list[bool]:
        held = [False] * len(block_hashes)
        for tier in self.tiers:
            held = [before or now for before, now in zip(held, tier.contains(block_hashes))]
        return held

    def snapshot(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats.snapshot(tier.used_bytes, tier.capacity_bytes) for tier in self.tiers}

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
            if not tier.contains((block_hash,))[0]:
                continue
            if not self._worth_loading(tier, num_tokens):
                tier.stats.skipped_slower_than_recompute += 1
                return None
            started = time.perf_counter()
            payload = tier.get((block_hash,))[0]
            if payload is None:  # a disk file that turned out corrupt or vanished: recompute
                continue
            tier.stats.hits += 1
            tier.stats.loaded_bytes += payload.numel()
            tier.stats.observe_load(time.perf_counter() - started)
            return payload, tier.name
        return None

    def _worth_loading(self, tier: Tier, num_tokens: int) -> bool:
        load_s = self.copier.payload_bytes / tier.read_bytes_per_s
        return load_s <= num_tokens / self.prefill_tokens_per_s

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine's measured prefill speed (an exponential average), what a load is compared against."""
        if num_tokens >= 64 and seconds > 0:
            self.prefill_tokens_per_s = 0.8 * self.prefill_tokens_per_s + 0.2 * (num_tokens / seconds)

    def close(self, pool_block_ids: list[int], pool_block_hashes: list[BlockHash],
              deadline: float | None = None) -> None:
        """At shutdown, with a persistent (disk) tier: what the pool and the tiers above still hold is saved
        into it (the blocks a restarted server will be asked for are mostly the recent ones), in bounded
        batches, until `deadline` (time.monotonic()); then every tier is closed, whatever happened."""
        try:
            bottom = self.tiers[-1]
            if bottom.persistent:
                self._save(bottom, pool_block_ids, pool_block_hashes, deadline)
        finally:
            for tier in self.tiers:
                tier.close(deadline)

    def _save(self, into: Tier, pool_block_ids: list[int], pool_block_hashes: list[BlockHash],
              deadline: float | None) -> None:
        step = max(1, self.save_batch_bytes // self.copier.payload_bytes)
        batches = [(pool_block_hashes[start:start + step],
                    partial(self.copier.read, pool_block_ids[start:start + step]))
                   for start in range(0, len(pool_block_ids), step)]
        for tier in self.tiers[:self.tiers.index(into)]:
            held = tier.hashes()  # least recent first, as the pool's blocks go before them
            batches += [(held[start:start + step], partial(tier.get, held[start:start + step]))
                        for start in range(0, len(held), step)]
        handed = 0
        for hashes, read in batches:
            if _past(deadline) or not into.flush(deadline):  # the last batch is stored before the next is read
                break
            present = [(block_hash, payload) for block_hash, payload in zip(hashes, read()) if payload is not None]
            into.put([block_hash for block_hash, _ in present], [payload for _, payload in present])
            handed += len(hashes)
        total = sum(len(hashes) for hashes, _ in batches)
        if into.flush(deadline) and handed == total:
            return
        logger.warning("KV tiers: saving to the %s tier stopped at its deadline (--kv-disk-save-timeout): %d of %d "
                       "cached blocks handed over, what was still queued dropped; the rest will be recomputed",
                       into.name, handed, total)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
