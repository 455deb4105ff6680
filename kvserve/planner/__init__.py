"""Capacity planning: pure arithmetic over model specs, no torch.

The engine sizes its KV pool with these functions, so `kvserve plan` and the engine's startup log agree:

    spec = load_spec("Qwen/Qwen2.5-14B-Instruct")
    block_bytes = kv_block_bytes(spec, block_size=16, kv_cache_dtype="auto", model_dtype="bfloat16")
    pool = kv_pool_bytes(total_memory_bytes, 0.9, weights_bytes, activation_bytes)
    num_blocks = num_blocks_for_pool(pool, block_bytes)
"""

from kvserve.planner.budget import (
    kv_pool_bytes,
    max_concurrency,
    max_model_len_for_blocks,
    num_blocks_for_pool,
)
from kvserve.planner.errors import PlannerError
from kvserve.planner.kv import (
    KV_CACHE_DTYPES,
    KVFormat,
    kv_block_bytes,
    kv_bytes_per_request,
    kv_bytes_per_token,
    kv_format,
)
from kvserve.planner.spec_loader import load_spec
from kvserve.planner.specs import ModelSpec, spec_from_hf_config

__all__ = [
    "KV_CACHE_DTYPES",
    "KVFormat",
    "ModelSpec",
    "PlannerError",
    "kv_block_bytes",
    "kv_bytes_per_request",
    "kv_bytes_per_token",
    "kv_format",
    "kv_pool_bytes",
    "load_spec",
    "max_concurrency",
    "max_model_len_for_blocks",
    "num_blocks_for_pool",
    "spec_from_hf_config",
]
