"""One process per disk-tier folder: an exclusive flock on `<folder>/.lock`, held while the tier is open.

Two servers on one folder would each enforce the capacity alone and delete each other's files. flock is
released by the kernel when the process exits however it exits, so a crashed server leaves no stale lock; the
file also names the holder's pid, for the error a second process gets. The file itself stays (removing it
would let a third process lock a new file while the second still holds the old one).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lock"


class FolderInUseError(OSError):
    """Another process holds the folder (an OSError: the engine's start-up reports it as it does a bad path)."""


class FolderLock:
    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_pid(descriptor)
            os.close(descriptor)
            raise FolderInUseError(
                f"KV disk tier {folder} is in use by another process" + (f" (pid {holder})" if holder else "")
                + ": one server per --kv-disk-path") from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._descriptor: int | None = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the last descriptor releases the flock
            self._descriptor = None


def _holder_pid(descriptor: int) -> int | None:
    try:
        return int(os.pread(descriptor, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
