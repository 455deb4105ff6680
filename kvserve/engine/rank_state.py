"""What each tensor-parallel rank builds at start-up, the same way on rank 0 (the engine) and on every worker:
its slice of the weights, its KV pool (sized by the planner's per-GPU formula, with the same block count on
every rank, so one block table addresses all of them) and the runner over both."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache, allocate_kv_storage, set_fp8_scales
from kvserve.config import EngineConfig
from kvserve.engine.kv_calibration import calibrate_key_offsets, calibration_text
from kvserve.engine.memory_profile import decode_gather_tokens
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.pool_sizing import PoolPlan, plan_kv_pool
from kvserve.model.loader import LoadedModel, load_model
from kvserve.planner.kv import key_staging_rows
from kvserve.model.tensor_parallel import TensorShard



@dataclass(slots=True)
class RankState:
    shard: TensorShard
    loaded: LoadedModel
    pool: PoolPlan
    storage: list[LayerKVCache]
    runner: ModelRunner
    fp8_scales: str | None  # where the fp8 scales came from, for the log; None: not an fp8 pool
    calibration_tokens: int = 0  # tokens of the start-up text a quantized pool measured its key offsets on
    cuda_graphs: str = ""  # what became of CUDA graphs for decode steps, for the log

    def describe_pool(self) -> str:
        if self.shard.size == 1:
            return self.pool.describe()
        return (f"rank {self.shard.rank}: {self.pool.describe()}; {self.loaded.num_kv_heads} KV heads of "
                f"{self.loaded.config.num_key_value_heads}, {self.loaded.weights_bytes / 2**20:.1f} MiB of weights")


def build_rank(config: EngineConfig, device: torch.device, shard: TensorShard,
               agree_num_blocks: Callable[[int], int] = lambda n: n) -> RankState:
    """`agree_num_blocks`: the fewest blocks any rank can hold (each rank measures its own device)."""
    loaded = load_model(config.model, config.dtype, device, shard, gguf_blocks=config.gguf_weights == "blocks")
    pool = plan_kv_pool(config, loaded, device)
    num_blocks = agree_num_blocks(pool.num_blocks)
    if num_blocks != pool.num_blocks:
        pool = dataclasses.replace(pool, num_blocks=num_blocks, source=pool.source + ", the smallest rank's")
    model_cfg, cache_cfg = loaded.config, config.cache
    storage = allocate_kv_storage(
        model_cfg.num_hidden_layers, pool.num_blocks, cache_cfg.block_size, loaded.num_kv_heads,
        model_cfg.head_dim, pool.kv_dtype, device, pool.kv_format, key_staging_rows(config.scheduler.max_num_seqs),
        pool.layout,
    )
    scales = set_fp8_scales(storage, loaded.model.checkpoint_kv_scales, cache_cfg.calculate_kv_scales)
    runner = ModelRunner(loaded.model, storage, cache_cfg.block_size, device,
                         max_gather_tokens=decode_gather_tokens(config.scheduler),
                         cascade_attention=not config.disable_cascade_attn, group_windows=pool.layout.windows,
                         attention_backend=config.attention_backend)
    calibration_tokens = 0
    if storage[0].quantized:
        # Every rank runs the same forward in step, so its collectives pair up.
        token_ids = loaded.tokenizer.encode(calibration_text())
        calibration_tokens = calibrate_key_offsets(runner, storage, token_ids)
    graphs = capture_decode_graphs(config, runner, pool.max_model_len)
    return RankState(shard, loaded, pool, storage, runner, scales, calibration_tokens, graphs)


def capture_decode_graphs(config: EngineConfig, runner: ModelRunner, max_model_len: int) -> str:
    """Captures the decode steps' CUDA graphs unless --enforce-eager or the set-up rules them out; says which."""
    if config.enforce_eager:
        return "CUDA graphs: off (--enforce-eager)"
    why_not = runner.graphs_unavailable()
    if why_not is None and config.parallel.tensor_parallel_size > 1:
        why_not = "tensor parallelism (its collectives run eagerly)"
    if why_not is not None:
        return f"CUDA graphs: off ({why_not})"
    started = time.perf_counter()
    count = runner.capture_decode_graphs(config.scheduler.max_num_seqs, max_model_len)
    sizes = runner.decode_graphs.sizes
    return (f"CUDA graphs: {count} decode batch sizes captured ({sizes[0]} to {sizes[-1]}) in "
            f"{time.perf_counter() - started:.1f} s")
