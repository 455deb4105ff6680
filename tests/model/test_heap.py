"""kvserve/heap.py: blocks a forward step frees stay in the C heap for the next layer, instead of going back to the
kernel and faulting in again (zeroed) when the next layer allocates them."""

import ctypes
import resource

import pytest

from kvserve.heap import KEPT_FREE_BYTES, MMAP_THRESHOLD_BYTES, keep_freed_blocks

BLOCK_BYTES = 16 << 20  # a prefill's activation, under the mmap threshold kept
BLOCKS = 8  # freed together: more than glibc's own trim threshold would keep


def _libc():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def faults_writing_blocks(libc) -> int:
    """Page faults while writing BLOCKS fresh blocks; they are freed after."""
    blocks = [libc.malloc(BLOCK_BYTES) for _ in range(BLOCKS)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for block in blocks:
        ctypes.memset(block, 1, BLOCK_BYTES)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for block in blocks:
        libc.free(block)
    return faults


def test_freed_blocks_are_written_again_without_faults():
    assert BLOCK_BYTES <= MMAP_THRESHOLD_BYTES and BLOCKS * BLOCK_BYTES <= KEPT_FREE_BYTES
    if not keep_freed_blocks():
        pytest.skip("not glibc, or the operator set its thresholds")
    libc = _libc()
    faults_writing_blocks(libc)  # the heap grows to hold them once
    pages = BLOCKS * BLOCK_BYTES // 4096
    assert faults_writing_blocks(libc) < pages // 16


def test_operator_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_blocks() is False
