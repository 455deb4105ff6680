"""Memory budget and block arithmetic. The engine calls these to size its pool, so plan and startup agree.

  KV pool = total GPU memory × --gpu-memory-utilization − weights − activation reserve   (per GPU)
  blocks  = ⌊pool ÷ block bytes⌋

This is vLLM's accounting: the utilization fraction applies to the card's total memory, not to what is free.
"""

from __future__ import annotations

from kvserve.planner.errors import PlannerError
from kvserve.planner.units import ceil_div


def kv_pool_bytes(
    total_memory_bytes: int, gpu_memory_utilization: float, weights_bytes: int, activation_bytes: int
) -> int:
    """Bytes left for the KV pool on one GPU. May be <= 0: then the model does not load with this budget."""
    if total_memory_bytes <= 0:
        raise PlannerError(f"GPU memory must be positive, got {total_memory_bytes} bytes")
    if not 0 < gpu_memory_utilization <= 1:
        raise PlannerError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if weights_bytes < 0 or activation_bytes < 0:
        raise PlannerError(f"weights ({weights_bytes}) and activation ({activation_bytes}) bytes must be >= 0")
    return memory_budget_bytes(total_memory_bytes, gpu_memory_utilization) - weights_bytes - activation_bytes


def memory_budget_bytes(total_memory_bytes: int, gpu_memory_utilization: float) -> int:
    return int(total_memory_bytes * gpu_memory_utilization)


def num_blocks_for_pool(pool_bytes: int, block_bytes: int) -> int:
    """Whole blocks that fit in the pool (0 when the pool is empty or negative)."""
    if block_bytes <= 0:
        raise PlannerError(f"block bytes must be positive, got {block_bytes}")
    return max(0, pool_bytes // block_bytes)


def blocks_per_request(context_len: int, block_size: int) -> int:
    if context_len <= 0 or block_size <= 0:
        raise PlannerError(f"context length ({context_len}) and block size ({block_size}) must be positive")
    return ceil_div(context_len, block_size)


def max_model_len_for_blocks(num_blocks: int, block_size: int) -> int:
    """The longest single request the pool can hold."""
    return max(0, num_blocks) * block_size


def max_concurrency(num_blocks: int, block_size: int, context_len: int) -> float:
    """How many requests of `context_len` tokens the pool holds at once (each rounded up to whole blocks)."""
    return max(0, num_blocks) / blocks_per_request(context_len, block_size)


def max_num_seqs_for_blocks(num_blocks: int, block_size: int, context_len: int) -> int:
    """The largest --max-num-seqs whose requests all fit at `context_len` tokens."""
    return max(0, num_blocks) // blocks_per_request(context_len, block_size)


def max_model_len_for_seqs(num_blocks: int, block_size: int, num_seqs: int) -> int:
    """The largest --max-model-len at which `num_seqs` full-length requests fit together."""
    if num_seqs <= 0:
        raise PlannerError(f"--max-num-seqs must be positive, got {num_seqs}")
    return (max(0, num_blocks) // num_seqs) * block_size
