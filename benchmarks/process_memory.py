"""Resident memory of a server, counted the way a machine's memory sees it: the process and every process it
started (vLLM's engine core, kvserve's tensor-parallel workers), RSS summed. Pages two of them share (the
shared libraries) count once per process, so the sum is an upper bound."""

from __future__ import annotations

import psutil


def tree_rss_bytes(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:  # exited while we looked
            pass
    return total
