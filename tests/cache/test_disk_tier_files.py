"""The disk tier owns its folder: at start it removes what it cannot use (another fingerprint, another layout,
partial files, headers of the wrong shape, temporaries of a killed write) and leaves others' files alone; one
process at a time; files 0600 in a 0700 folder, each fsynced before it is renamed into place; a bounded write
queue."""

import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvserve.cache.storage.block_file import LAYOUT_VERSION, MAGIC, SUFFIX, encode_block_file
from kvserve.cache.storage import disk_tier
from kvserve.cache.storage.disk_tier import DiskTier

FINGERPRINT = "the-model-and-format"
PAYLOAD_BYTES = 4096
CAPACITY = 2**30


def payload(seed: int) -> torch.Tensor:
    return (torch.arange(PAYLOAD_BYTES, dtype=torch.int64) * (seed + 3) % 251).to(torch.uint8)


def block_file(seed: int, fingerprint: str = FINGERPRINT) -> bytes:
    return encode_block_file(fingerprint, payload(seed).numpy().tobytes())


def with_header(header: object, body: bytes = bytes(PAYLOAD_BYTES)) -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


def name(index: int, suffix: str = SUFFIX) -> str:
    return f"{index:032x}{suffix}"


def test_start_removes_the_files_it_cannot_use_and_keeps_the_rest(tmp_path):
    good = block_file(0)
    unusable = {
        name(1): block_file(1, fingerprint="another-model"),  # another model, format or checkpoint
        name(2): good.replace(f'"layout": {LAYOUT_VERSION}'.encode(), f'"layout": {LAYOUT_VERSION - 1}'.encode()),
        name(3): good[: len(good) // 2],  # truncated
        name(4): b"not a block file at all",
        name(5): with_header([LAYOUT_VERSION, FINGERPRINT]),  # JSON, but not an object
        name(6): with_header({"layout": LAYOUT_VERSION, "fingerprint": FINGERPRINT, "length": str(PAYLOAD_BYTES),
                              "xxh3_64": "0"}),  # an object with a field of the wrong type
        name(7, SUFFIX + ".tmp"): good,  # a write cut short (killed before its rename)
        name(8, ".tmp"): good,  # the temporary name of earlier versions
    }
    for file_name, data in {name(0): good, **unusable}.items():
        (tmp_path / file_name).write_bytes(data)
    (tmp_path / "NOTES.txt").write_text("an operator's file: not the tier's")

    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    try:
        remaining = sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith("."))
        assert remaining == sorted(["NOTES.txt", name(0)])
        assert torch.equal(tier.get([bytes.fromhex(name(0).removesuffix(SUFFIX))])[0], payload(0))
    finally:
        tier.close()


def test_a_header_of_the_wrong_shape_found_while_serving_is_a_miss_not_an_error(tmp_path):
    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    try:
        block_hash = bytes(16)
        tier.put([block_hash], [payload(0)])
        assert tier.flush()
        (tmp_path / f"{block_hash.hex()}{SUFFIX}").write_bytes(with_header([LAYOUT_VERSION, FINGERPRINT]))
        assert tier.get([block_hash]) == [None]  # recomputed
        assert not (tmp_path / f"{block_hash.hex()}{SUFFIX}").exists()
    finally:
        tier.close()


def test_files_are_the_owners_alone(tmp_path):
    folder = tmp_path / "kv" / "tier"
    old_umask = os.umask(0o022)  # the usual umask: without asking, a file would be 0644 and a folder 0755
    try:
        tier = DiskTier(folder, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
        tier.put([bytes(16)], [payload(0)])
        tier.close()
    finally:
        os.umask(old_umask)
    assert [stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "kv", folder)] == [0o700, 0o700]
    files = list(folder.iterdir())
    assert any(path.name.endswith(SUFFIX) for path in files)
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files)


def test_each_file_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source, target):
        events.append(("rename", str(source)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    tier.put([bytes(16), bytes([1] * 16)], [payload(0), payload(1)])
    tier.close()
    renames = [path for kind, path in events if kind == "rename"]
    assert len(renames) == 2
    for path in renames:
        assert events.index(("fsync", path)) < events.index(("rename", path))


def test_blocks_beyond_the_write_queue_are_counted_not_written_and_the_rest_are_stored(tmp_path, monkeypatch):
    disk_free = threading.Event()  # the writer waits on it: a disk slower than the blocks arrive
    real_write = disk_tier.write_durably

    def slow_write(path, data):
        disk_free.wait()
        real_write(path, data)

    monkeypatch.setattr(disk_tier, "write_durably", slow_write)
    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES, max_pending_bytes=2 * PAYLOAD_BYTES)
    hashes = [index.to_bytes(16, "big") for index in range(5)]
    try:
        tier.put(hashes, [payload(index) for index in range(5)])
        assert tier.stats.skipped_writes == 3
        assert tier.contains(hashes) == [True, True, False, False, False]
        disk_free.set()
        assert tier.flush(deadline=time.monotonic() + 60)
        assert all(torch.equal(got, payload(index)) for index, got in enumerate(tier.get(hashes[:2])))
        tier.put(hashes[2:4], [payload(index) for index in range(2, 4)])  # room again once written
    finally:
        tier.close()
    assert tier.stats.skipped_writes == 3
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.endswith(SUFFIX)) == \
        sorted(f"{block_hash.hex()}{SUFFIX}" for block_hash in hashes[:4])


SECOND_PROCESS = textwrap.dedent("""
    import sys
    from kvserve.cache.storage.disk_tier import DiskTier
    tier = DiskTier(sys.argv[1], 2**30, "the-model-and-format", 4096)
    tier.close()
    print("opened")
""")


def open_in_another_process(folder):
    return subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(folder)], capture_output=True, text=True,
                          timeout=120)


def test_a_second_process_on_the_same_folder_is_refused_by_name(tmp_path):
    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    try:
        tier.put([bytes(16)], [payload(0)])
        assert tier.flush()
        refused = open_in_another_process(tmp_path)
        assert refused.returncode != 0 and "opened" not in refused.stdout
        assert str(tmp_path) in refused.stderr and f"pid {os.getpid()}" in refused.stderr
        assert (tmp_path / f"{bytes(16).hex()}{SUFFIX}").exists()  # it removed nothing on its way out
    finally:
        tier.close()
    assert open_in_another_process(tmp_path).stdout.strip() == "opened"  # free once the holder closed it


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", SECOND_PROCESS.replace("tier.close()", "import time; "
                                                                            "print('holding', flush=True); "
                                                                            "time.sleep(600)"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(OSError, match=f"in use by another process \\(pid {holder.pid}\\)"):
            DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    finally:
        holder.kill()
        holder.wait()
    DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES).close()


def test_close_at_a_passed_deadline_drops_the_queue_and_leaves_no_partial_file(tmp_path):
    tier = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)
    hashes = [index.to_bytes(16, "big") for index in range(200)]
    tier.put(hashes, [payload(index) for index in range(200)])
    tier.close(deadline=time.monotonic())
    names = [path.name for path in tmp_path.iterdir() if not path.name.startswith(".")]
    assert all(file_name.endswith(SUFFIX) for file_name in names)  # written whole, or not at all
    reopened = DiskTier(tmp_path, CAPACITY, FINGERPRINT, PAYLOAD_BYTES)  # the folder is free again
    try:
        held = [block_hash for block_hash, is_held in zip(hashes, reopened.contains(hashes)) if is_held]
        assert len(held) == len(names)
        assert all(torch.equal(got, payload(hashes.index(h))) for h, got in zip(held, reopened.get(held)))
    finally:
        reopened.close()
