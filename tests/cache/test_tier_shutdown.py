"""Saving the pool to the disk tier at shutdown (KVTiers.close): in batches of a fixed size whatever the pool's
size, each written before the next is read, so what saving holds in memory does not grow with the pool; and a
deadline (--kv-disk-save-timeout) stops it cleanly."""

import logging
import time

import pytest
import torch

from kvserve.cache.storage.block_copier import BlockCopier
from kvserve.cache.storage.disk_tier import DiskTier
from kvserve.cache.storage.host_tier import HostTier
from kvserve.cache.storage.kv_storage import allocate_kv_storage
from kvserve.cache.storage.kv_tiers import KVTiers

BATCH_BLOCKS = 8


class RecordingCopier(BlockCopier):
    """The real copier, noting the largest batch of blocks it was asked to read and whether the disk tier still
    had blocks queued at the time (the payloads alive at once: one batch read, plus what is queued)."""

    def __init__(self, layers) -> None:
        super().__init__(layers)
        self.largest_batch = 0
        self.read_while_queued = 0
        self.disk: DiskTier | None = None

    def read(self, block_ids):
        self.largest_batch = max(self.largest_batch, len(block_ids))
        if not self.disk.flush(deadline=time.monotonic()):
            self.read_while_queued += 1
        return super().read(block_ids)


def filled_pool(num_blocks: int):
    generator = torch.Generator().manual_seed(num_blocks)
    layers = allocate_kv_storage(2, num_blocks, 16, 2, 16, torch.float32)
    for tensor in (t for layer in layers for t in layer.tensors()):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return layers


def tiers_over(layers, folder, host_blocks: int = 0) -> tuple[KVTiers, RecordingCopier]:
    copier = RecordingCopier(layers)
    disk = DiskTier(folder, 2**30, "fingerprint", copier.payload_bytes)
    copier.disk = disk
    host = [HostTier(host_blocks * copier.payload_bytes)] if host_blocks else []
    tiers = KVTiers(copier, [*host, disk])
    tiers.save_batch_bytes = BATCH_BLOCKS * copier.payload_bytes
    return tiers, copier


def block_hash(index: int) -> bytes:
    return index.to_bytes(16, "big")


@pytest.mark.parametrize("num_blocks", [40, 640])
def test_saving_reads_batches_of_a_fixed_size_whatever_the_pool_size(tmp_path, num_blocks):
    layers = filled_pool(num_blocks)
    tiers, copier = tiers_over(layers, tmp_path)
    block_ids = list(range(num_blocks))
    tiers.close(block_ids, [block_hash(i) for i in block_ids], deadline=time.monotonic() + 600)
    assert copier.largest_batch == BATCH_BLOCKS  # not num_blocks: one read of the whole pool held it twice
    assert copier.read_while_queued == 0  # each batch was on disk before the next was read
    reopened = DiskTier(tmp_path, 2**30, "fingerprint", copier.payload_bytes)
    try:
        saved = reopened.get([block_hash(i) for i in block_ids])
        expected = BlockCopier(layers).read(block_ids)
        assert all(got is not None and torch.equal(got, want) for got, want in zip(saved, expected))
    finally:
        reopened.close()


def test_the_host_tier_is_saved_in_batches_too(tmp_path):
    layers = filled_pool(64)
    tiers, copier = tiers_over(layers, tmp_path, host_blocks=32)
    tiers.offload(list(range(32)), [block_hash(i) for i in range(32)])  # into the host tier, as evictions do
    copier.largest_batch = 0
    tiers.close([32, 33], [block_hash(32), block_hash(33)], deadline=time.monotonic() + 600)
    assert copier.largest_batch == 2
    reopened = DiskTier(tmp_path, 2**30, "fingerprint", copier.payload_bytes)
    try:
        assert all(reopened.contains([block_hash(i) for i in range(34)]))
    finally:
        reopened.close()


def test_a_passed_deadline_stops_saving_cleanly(tmp_path, caplog):
    layers = filled_pool(64)
    tiers, copier = tiers_over(layers, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        tiers.close(list(range(64)), [block_hash(i) for i in range(64)], deadline=time.monotonic())
    assert copier.largest_batch == 0  # nothing read after the deadline
    assert any("deadline" in record.message and "0 of 64" in record.message for record in caplog.records)
    assert not [path for path in tmp_path.iterdir() if not path.name.startswith(".")]
    DiskTier(tmp_path, 2**30, "fingerprint", copier.payload_bytes).close()  # the tier let go of its folder
