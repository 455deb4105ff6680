"""The C heap of a CPU serving process. A forward step allocates its activations (a long prompt's are tens of MB
each) and frees them layer after layer; by default glibc hands such blocks back to the kernel (blocks above its
mmap threshold are unmapped when freed, and the heap's free top is trimmed above its trim threshold), so the next
layer's allocation faults every page in again, each zeroed by the kernel first. keep_freed_blocks raises both
thresholds so blocks up to glibc's largest mmap threshold come from the heap and stay there for the next layer,
as tcmalloc or jemalloc (which CPU serving guides preload) would keep them. What the heap keeps free at its top
is still bounded (KEPT_FREE_BYTES). Anywhere but glibc, and where the operator set either threshold through
glibc's variables, nothing changes.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the most glibc accepts on 64-bit systems
KEPT_FREE_BYTES = 256 << 20
OPERATOR_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_blocks() -> bool:
    """Raises glibc's mmap and trim thresholds for this process; True when they were set."""
    if any(name in os.environ for name in OPERATOR_VARIABLES):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc
