"""Optional C++ kernels for CPUs, compiled on first use with torch's extension builder (needs a C++ compiler
and ninja). Everything here has a portable torch fallback: if the build fails, kvserve logs why and runs the
portable path, never fails.

Set KVSERVE_CPU_KERNELS=0 to force the portable path.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

logger = logging.getLogger("kvserve.model")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "prefill_attention.cpp")]


@cache
def cpu_kernels():
    """The compiled module (paged decode and prefill attention, the fused ops), or None when it cannot be built.

    The prefill kernel exists only where the compiler targets AVX512-BF16: check `has_prefill_attention()`.
    """
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="kvserve_paged_attention",
            sources=[str(source) for source in SOURCES],
            # -fopenmp: at::parallel_for is header code that runs serially unless OpenMP is on at compile time.
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("CPU paged-attention kernels unavailable (%s); using the portable torch path", exc)
        return None
