"""The disk tier: one file per block under `--kv-disk-path` (block_file.py), LRU within `--kv-disk-size`,
surviving restarts. The folder belongs to the tier and to one process at a time (folder_lock.py).

A file is only ever read into the pool when its layout, fingerprint, length and checksum all match. At start-up
the tier removes what it cannot use: block files of another fingerprint (another model, checkpoint, KV format
or layout), partial or corrupt ones, JSON headers of the wrong shape, and the temporaries of writes a killed
process left; other files in the folder are left alone. A file found corrupt at read time is deleted and its
tokens recomputed. Files are written 0600 to a temporary name, fsynced, then renamed, on a worker thread; a full
disk or any I/O error logs one warning and degrades to recompute, never fails a request.

Blocks queued beyond MAX_PENDING_BYTES (a disk slower than evictions arrive) are not written, and counted
(`kvserve:kv_tier_skipped_writes`): their tokens are recomputed if asked for again. Memory stays bounded.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash

from kvserve.cache.block_hash import BlockHash
from kvserve.cache.storage.block_file import (LAYOUT_VERSION, SUFFIX, TEMPORARY_SUFFIX, block_hash_of,
                                              encode_block_file, read_header)
from kvserve.cache.storage.folder_lock import FolderLock
from kvserve.cache.storage.tier import Evicted
from kvserve.cache.tier_stats import TierStats
from kvserve.private_paths import make_private_folders

logger = logging.getLogger("kvserve.cache")

DEFAULT_DISK_BYTES_PER_S = 1e9  # until a read has been timed
MAX_PENDING_BYTES = 256 * 2**20  # payloads queued for the writer, readable meanwhile


class DiskTier:
    name = "disk"
    persistent = True

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str, payload_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.stats = TierStats()
        self.read_bytes_per_s = DEFAULT_DISK_BYTES_PER_S
        self.removed_files = 0  # at start-up: files of this tier it could not use
        make_private_folders(self.path)
        self._folder_lock = FolderLock(self.path)  # before anything is read or removed: raises if another holds it
        self.index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, least recent first
        self.used_bytes = 0
        self._pending: dict[BlockHash, torch.Tensor] = {}  # queued for the writer, readable meanwhile
        self._pending_bytes = 0
        self.max_pending_bytes = max(max_pending_bytes, payload_bytes)  # room for one block at least
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._warned = False
        try:
            self._scan()
        except BaseException:
            self._folder_lock.release()
            raise
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-tier", daemon=True)
        self._writer.start()

    # ---- start-up ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Indexes the files a previous run left that this run can read, oldest access first; removes the
        tier's files it cannot use."""
        found = []
        for file in self.path.iterdir():
            block_hash = block_hash_of(file.name)
            if block_hash is None:
                continue  # not the tier's (the lock, an operator's note): left alone
            if not file.name.endswith(TEMPORARY_SUFFIX) and self._readable(file):
                stat = file.stat()
                found.append((stat.st_mtime, block_hash, stat.st_size))
            else:
                self._remove(file)
        for _, block_hash, size in sorted(found):
            self.index[block_hash] = size
            self.used_bytes += size
        self._evict_over_capacity()
        if self.index or self.removed_files:
            logger.info("KV disk tier %s: %d blocks from earlier runs; %d files removed (another model, format or "
                        "layout, incomplete, or corrupt)", self.path, len(self.index), self.removed_files)

    def _remove(self, file: Path) -> None:
        try:
            file.unlink(missing_ok=True)
            self.removed_files += 1
        except OSError as exc:
            logger.warning("KV disk tier: cannot remove %s (%s); it is ignored", file, exc)

    def _readable(self, file: Path) -> bool:
        try:
            with open(file, "rb") as handle:
                header = read_header(handle)
                size = os.fstat(handle.fileno()).st_size
                return self._header_matches(header) and size == handle.tell() + header["length"]
        except OSError:
            return False

    def _header_matches(self, header: dict | None) -> bool:
        return (header is not None and header["layout"] == LAYOUT_VERSION
                and header["fingerprint"] == self.fingerprint and header["length"] == self.payload_bytes)

    # ---- the tier ------------------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [block_hash in self.index or block_hash in self._pending for block_hash in hashes]

    def put(self, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> Evicted:
        """Queues the blocks for the writer thread; what the disk must evict to make room is deleted there."""
        for block_hash, payload in zip(hashes, payloads):
            with self._lock:
                if block_hash in self.index or block_hash in self._pending:
                    continue
                if self._pending_bytes + payload.numel() > self.max_pending_bytes:
                    self._skip_write()
                    continue
                self._pending[block_hash] = payload
                self._pending_bytes += payload.numel()
            self._queue.put(block_hash)
        return []

    def _skip_write(self) -> None:
        """Under the lock: a block the writer has no room for."""
        self.stats.skipped_writes += 1
        if self.stats.skipped_writes == 1:
            logger.warning("KV disk tier: %.1f MiB of blocks are waiting to be written; blocks beyond are not written "
                           "(the disk is slower than blocks are evicted) and their tokens are recomputed",
                           self.max_pending_bytes / 2**20)

    def get(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        return [self._get_one(block_hash) for block_hash in hashes]

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return [*self.index, *(block_hash for block_hash in self._pending if block_hash not in self.index)]

    def _get_one(self, block_hash: BlockHash) -> torch.Tensor | None:
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                return pending
            if block_hash not in self.index:
                return None
            self.index.move_to_end(block_hash)
        file = self._file(block_hash)
        started = time.perf_counter()
        try:
            with open(file, "rb") as handle:
                header = read_header(handle)
                payload = handle.read()
        except OSError as exc:
            self._drop(block_hash, f"cannot read {file}: {exc}")
            return None
        if not self._header_matches(header) or len(payload) != header["length"] \
                or xxhash.xxh3_64_hexdigest(payload) != header["xxh3_64"]:
            self._drop(block_hash, f"{file} is corrupt or from another model; recomputing its tokens")
            return None
        seconds = time.perf_counter() - started
        if seconds > 0:
            self.read_bytes_per_s = 0.8 * self.read_bytes_per_s + 0.2 * (len(payload) / seconds)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _file(self, block_hash: BlockHash) -> Path:
        return self.path / f"{block_hash.hex()}{SUFFIX}"

    def _drop(self, block_hash: BlockHash, why: str) -> None:
        logger.warning("KV disk tier: %s", why)
        with self._lock:
            self.used_bytes -= self.index.pop(block_hash, 0)
        self._file(block_hash).unlink(missing_ok=True)

    # ---- the writer thread -----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            if block_hash is None:
                return
            with self._lock:
                payload = self._pending.get(block_hash)
            if payload is not None:  # else dropped by close
                self._write(block_hash, payload)
            with self._lock:
                if self._pending.pop(block_hash, None) is not None:
                    self._pending_bytes -= payload.numel()

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        data = encode_block_file(self.fingerprint, payload.numpy().tobytes())
        file = self._file(block_hash)
        temporary = file.with_name(file.name + TEMPORARY_SUFFIX)
        try:
            write_durably(temporary, data)
            os.replace(temporary, file)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            if not self._warned:  # once: a full disk would otherwise log every block
                logger.warning("KV disk tier: cannot write %s (%s); blocks that do not fit are recomputed", file, exc)
                self._warned = True
            return
        with self._lock:
            self.index[block_hash] = len(data)
            self.used_bytes += len(data)
            self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while self.used_bytes > self.capacity_bytes and self.index:
            old_hash, size = self.index.popitem(last=False)
            self.used_bytes -= size
            self._file(old_hash).unlink(missing_ok=True)

    def flush(self, deadline: float | None = None) -> bool:
        """Waits until every queued block is on disk, or until `deadline` (time.monotonic()); True when it is."""
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self, deadline: float | None = None) -> None:
        """Writes what is queued until `deadline`; what is left then is dropped (the writer finishes the one
        file it is on, so no file is left half-written under its name). Then the folder is free for another
        process."""
        if not self.flush(deadline):
            with self._lock:
                self._pending.clear()
                self._pending_bytes = 0
        self._queue.put(None)
        self._writer.join(timeout=10)
        self._folder_lock.release()


def write_durably(path: Path, data: bytes) -> None:
    """Writes a new file, the owner's alone (0600: it holds K/V computed from users' prompts), and fsyncs it, so
    the rename that publishes it can never land before its bytes (a crash then leaves no empty or partial file
    under the final name)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
