"""This machine's bounds, measured: memory bandwidth (bytes a second a reduction streams from DRAM) and matmul
peak (FLOP a second of a large GEMM in a dtype), with every thread torch uses. Benchmarks divide their figures by
these to print the fraction of the machine they reach."""

from __future__ import annotations

import time
from functools import cache

import torch


def best_seconds(run, repeats: int = 5) -> float:
    run()  # warm-up: page faults, oneDNN's code generation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


@cache
def memory_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a sum over a buffer far larger than the caches (a read stream, as decode's weights and KV are)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / best_seconds(lambda: buffer.sum())


@cache
def matmul_peak(dtype: torch.dtype = torch.bfloat16, size: int = 2048) -> float:
    """FLOP/s of one [size, size] x [size, size] matmul in `dtype` (torch's oneDNN GEMM)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b))


def compute_peak() -> float:
    """The faster of the bf16 and fp32 GEMMs: what the machine allows an engine free to pick its dtype (a CPU
    without bf16 instructions, or one capped to AVX2, only emulates bf16)."""
    return max(matmul_peak(torch.float32), matmul_peak(torch.bfloat16))


def describe() -> str:
    return (f"memory bandwidth {memory_bandwidth() / 1e9:.1f} GB/s, matmul peak {matmul_peak() / 1e9:.0f} GFLOP/s "
            f"bf16 / {matmul_peak(torch.float32) / 1e9:.0f} fp32, {torch.get_num_threads()} threads")
