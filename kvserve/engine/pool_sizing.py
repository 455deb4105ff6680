"""Sizes the KV block pool with the planner's arithmetic, so `kvserve plan` and the start-up log agree.

CPU: the pool is `--kv-cache-memory` GiB. CUDA: `--gpu-memory-utilization` of the card minus what the process
holds after loading (weights, rotary tables) and the activation peak of profiling forwards (memory_profile.py).
`--num-gpu-blocks-override` wins over both (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.memory_profile import activation_peak_bytes
from kvserve.model.loader import DTYPES, LoadedModel
from kvserve.planner.budget import kv_pool_bytes, memory_budget_bytes, num_blocks_for_pool
from kvserve.planner.kv import kv_block_bytes, kv_format, kv_key_staging_bytes, kv_layout
from kvserve.planner.kv_groups import KVCacheLayout
from kvserve.planner.specs import spec_from_hf_config

DEFAULT_CPU_KV_CACHE_GIB = 1.0
GIB = 2**30
MIB = 2**20
# What CUDA sizing cannot measure before the pool exists: the caching allocator rounds each large KV tensor up
# to a 2 MiB multiple, and another thread (the server's engine loop) gets its own cuBLAS workspace.
CUDA_ROUNDING_PER_KV_TENSOR = 2 * MIB
CUDA_UNPROFILED_BYTES = 64 * MIB


class PoolTooSmall(RuntimeError):
    """The pool cannot hold one request of --max-model-len, or the GPU lacks the memory asked for: the engine
    refuses to start."""


@dataclass(slots=True)
class PoolPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int
    kv_dtype: torch.dtype  # the unquantized KV dtype (what attention reads quantized K/V back as)
    source: str  # how the pool size was chosen, for the log
    kv_format: str = ""  # what the pool stores: the KV dtype's name, or fp8_e4m3 / fp8_e5m2 / int8 / int4
    layout: KVCacheLayout | None = None  # the layers' KV cache groups (planner/kv_groups.py); None: one of all

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_per_request(self, context_len: int) -> int:
        """Pool blocks one request of `context_len` tokens holds (the planner's formula)."""
        if self.layout is None:
            return -(-context_len // self.block_size)
        return self.layout.blocks_per_request(context_len, self.block_size)

    def describe(self) -> str:
        concurrency = self.num_blocks / self.blocks_per_request(self.max_model_len)
        layout = self.layout
        if layout is not None and layout.is_hybrid:
            windows = ", ".join("full" if w is None else f"window {w}" for w in layout.windows)
            held = (f"{self.num_blocks} blocks x {self.block_size} tokens of one KV cache group's {layout.num_slots} "
                    f"layers ({len(layout.groups)} groups: {windows}), {self.kv_format} KV "
                    f"({self.block_bytes / self.block_size / layout.num_slots:,.0f} B per token and layer, scales "
                    "included)")
        else:
            held = (f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens of "
                    f"{self.kv_format} KV ({self.block_bytes / self.block_size:,.0f} B/token, scales included)")
        return (f"KV cache pool: {self.pool_bytes / GIB:.2f} GiB ({self.source}) = {held}; maximum concurrency at "
                f"max-model-len {self.max_model_len}: {concurrency:.2f}x")


def kv_storage_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The unquantized KV dtype: --kv-cache-dtype's, or the model's (the checkpoint's 16 bits when auto computes
    it in fp32) under auto and under a quantized format."""
    return DTYPES.get(config.cache.kv_cache_dtype, loaded.kv_dtype)


def kv_format_name(config: EngineConfig, loaded: LoadedModel) -> str:
    """What the pool stores, in the planner's spelling (fp8 is fp8_e4m3)."""
    name = config.cache.kv_cache_dtype
    if name in DTYPES or name == "auto":
        return _dtype_name(kv_storage_dtype(config, loaded))
    return kv_format(name).name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_kv_pool(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> PoolPlan:
    cache = config.cache
    spec = spec_from_hf_config(loaded.hf_config, source=str(loaded.path))
    kv_name = kv_format_name(config, loaded)
    layout = kv_layout(spec, hybrid=not config.disable_hybrid_kv_cache_manager)
    block_bytes = kv_block_bytes(spec, cache.block_size, kv_name, _dtype_name(loaded.dtype),
                                 config.parallel.tensor_parallel_size, layout=layout)
    model_limit = loaded.config.max_position_embeddings
    if (config.scheduler.max_model_len or 0) > model_limit:
        raise ValueError(
            f"--max-model-len {config.scheduler.max_model_len} exceeds the model's maximum context of {model_limit} "
            "tokens"
        )
    if cache.num_gpu_blocks_override is not None:
        num_blocks, source = cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
    elif device.type == "cuda":
        num_blocks, source = _cuda_blocks(config, loaded, device, block_bytes)
    else:
        gib = cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_GIB
        staging = key_staging_bytes(config, loaded)
        num_blocks = num_blocks_for_pool(int(gib * GIB) - staging, block_bytes)
        source = f"--kv-cache-memory {gib:g} GiB" + (f", {staging / MIB:.1f} MiB of it staging int4 keys" if staging else "")
    chunk = config.scheduler.max_num_batched_tokens
    largest_fit = layout.longest_context(num_blocks, cache.block_size, chunk, model_limit)
    max_model_len = config.scheduler.max_model_len or largest_fit
    if max_model_len > largest_fit:
        needed = layout.peak_blocks_per_request(max_model_len, cache.block_size, chunk)
        raise PoolTooSmall(
            f"one request of --max-model-len {max_model_len} needs {needed} blocks but the KV pool has {num_blocks} "
            f"({source}); the largest max-model-len that fits is {largest_fit}. Lower --max-model-len or give the "
            f"pool more memory."
        )
    return PoolPlan(num_blocks, cache.block_size, block_bytes, max_model_len,
                    kv_storage_dtype(config, loaded), source, kv_name, layout)


def key_staging_bytes(config: EngineConfig, loaded: LoadedModel) -> int:
    """What the pool's int4 key staging (cache/storage/key_staging.py) holds beside it, taken from the pool's memory."""
    spec = spec_from_hf_config(loaded.hf_config, source=str(loaded.path))
    return kv_key_staging_bytes(spec, config.cache.block_size, config.scheduler.max_num_seqs,
                                kv_format_name(config, loaded), _dtype_name(kv_storage_dtype(config, loaded)),
                                config.parallel.tensor_parallel_size)


def _cuda_blocks(config: EngineConfig, loaded: LoadedModel, device: torch.device, block_bytes: int) -> tuple[int, str]:
    utilization = config.cache.gpu_memory_utilization
    free, total = torch.cuda.mem_get_info(device)
    budget = memory_budget_bytes(total, utilization)
    usable = free + torch.cuda.memory_reserved(device)  # what others leave us, plus what this process holds
    if usable < budget:
        raise PoolTooSmall(
            f"--gpu-memory-utilization {utilization} asks for {budget / GIB:.2f} GiB of the {total / GIB:.1f} GiB on "
            f"{device}, but other processes hold {(total - usable) / GIB:.2f} GiB; lower --gpu-memory-utilization "
            f"(at most {usable / total:.2f} fits now) or free the GPU"
        )
    resident = torch.cuda.memory_allocated(device)  # weights, rotary tables: everything loaded so far
    activation_bytes = activation_peak_bytes(config, loaded, device)
    unmeasured = CUDA_UNPROFILED_BYTES + 2 * loaded.config.num_hidden_layers * CUDA_ROUNDING_PER_KV_TENSOR
    pool = kv_pool_bytes(total, utilization, resident, activation_bytes) - unmeasured - key_staging_bytes(config, loaded)
    source = (f"--gpu-memory-utilization {utilization} of {total / GIB:.1f} GiB, model {resident / GIB:.2f} GiB, "
              f"activations {activation_bytes / GIB:.2f} GiB")
    return num_blocks_for_pool(pool, block_bytes), source
