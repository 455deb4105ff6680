"""The disk tier: one file per block under `--kv-disk-path`, LRU within `--kv-disk-size`, surviving restarts.

A file is `<hash hex>.kvblock`:

    magic (8 B) | header length (4 B) | header JSON | payload

The header carries the layout version, the fingerprint of what wrote it (model weights' identity, dtype, KV
format, block size, shapes: see engine/tier_setup.py), the payload length and its xxh3-64 checksum. A file is
only ever read into the pool when all of them match; anything else (partial, corrupt, another model, another
format, an older layout) is ignored at start-up and recomputed, and a file found corrupt at read time is
deleted. Files are written to a temporary name and renamed, on a worker thread; a full disk or any I/O error
logs one warning and degrades to recompute, never fails a request.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash

from kvserve.cache.block_hash import BlockHash
from kvserve.cache.storage.tier import Evicted
from kvserve.cache.tier_stats import TierStats

logger = logging.getLogger("kvserve.cache")

MAGIC = b"KVSBLK01"
LAYOUT_VERSION = 3  # 2: quantized keys are stored less their layer's key offset; 3: int4 keys per channel and block
SUFFIX = ".kvblock"
DEFAULT_DISK_BYTES_PER_S = 1e9  # until a read has been timed


def encode_block_file(fingerprint: str, payload: bytes) -> bytes:
    header = json.dumps({"layout": LAYOUT_VERSION, "fingerprint": fingerprint, "length": len(payload),
                         "xxh3_64": xxhash.xxh3_64_hexdigest(payload)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def read_header(handle) -> dict | None:
    """The header of an open block file, or None when it is not one."""
    if handle.read(len(MAGIC)) != MAGIC:
        return None
    raw_length = handle.read(4)
    if len(raw_length) != 4:
        return None
    (length,) = struct.unpack("<I", raw_length)
    if length > 4096:
        return None
    try:
        return json.loads(handle.read(length))
    except ValueError:
        return None


class DiskTier:
    name = "disk"
    persistent = True

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str, payload_bytes: int) -> None:
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.stats = TierStats()
        self.read_bytes_per_s = DEFAULT_DISK_BYTES_PER_S
        self.ignored_files = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self.index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, least recent first
        self.used_bytes = 0
        self._pending: dict[BlockHash, torch.Tensor] = {}  # queued for the writer, readable meanwhile
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._warned = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-tier", daemon=True)
        self._writer.start()

    # ---- start-up ------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Indexes the files a previous run left that this run can read, oldest access first."""
        found = []
        for file in self.path.glob(f"*{SUFFIX}"):
            block_hash = self._hash_of(file)
            if block_hash is not None and self._readable(file):
                stat = file.stat()
                found.append((stat.st_mtime, block_hash, stat.st_size))
            else:
                self.ignored_files += 1
        for _, block_hash, size in sorted(found):
            self.index[block_hash] = size
            self.used_bytes += size
        self._evict_over_capacity()
        if self.index or self.ignored_files:
            logger.info("KV disk tier %s: %d blocks from earlier runs, %d files ignored (another model, format or "
                        "layout, or incomplete)", self.path, len(self.index), self.ignored_files)

    @staticmethod
    def _hash_of(file: Path) -> BlockHash | None:
        try:
            return bytes.fromhex(file.name.removesuffix(SUFFIX))
        except ValueError:
            return None

    def _readable(self, file: Path) -> bool:
        try:
            with open(file, "rb") as handle:
                header = read_header(handle)
                size = os.fstat(handle.fileno()).st_size
                return self._header_matches(header) and size == handle.tell() + header["length"]
        except OSError:
            return False

    def _header_matches(self, header: dict | None) -> bool:
        return (header is not None and header.get("layout") == LAYOUT_VERSION
                and header.get("fingerprint") == self.fingerprint and header.get("length") == self.payload_bytes)

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
                self._pending[block_hash] = payload
            self._queue.put(block_hash)
        return []

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
            if payload is not None:
                self._write(block_hash, payload)
            with self._lock:
                self._pending.pop(block_hash, None)

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        data = encode_block_file(self.fingerprint, payload.numpy().tobytes())
        file = self._file(block_hash)
        temporary = file.with_suffix(".tmp")
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
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
        file it is on, so no file is left half-written under its name)."""
        if not self.flush(deadline):
            with self._lock:
                self._pending.clear()
        self._queue.put(None)
        self._writer.join(timeout=10)
