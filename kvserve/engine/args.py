"""Engine flags, named and defaulted as vLLM's, shared by `kvserve generate | chat | serve`."""

from __future__ import annotations

import argparse

from kvserve.config import ATTENTION_BACKENDS, GGUF_WEIGHTS, CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="local Hugging Face folder or .gguf file (default: the built-in SmolLM2-135M-Instruct demo)")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "half", "float"],
                       help="weights and activations dtype (auto: the checkpoint's; bf16 for GGUF)")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--disable-cascade-attn", action="store_true",
                       help="decodes that share cached prefix blocks read them each on their own, instead of once "
                            "per step for the group (CPU kernels)")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="one block table for all layers: sliding-window layers (Gemma 2/3, Mistral) keep the K/V "
                            "of every token as full-attention layers do, instead of only their window's")
    group.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="the attention kernels: auto (cpu on CPU, triton on CUDA), cpu (the C++ kernels), triton "
                            "(on CPU tensors only under Triton's interpreter: for tests), torch (the portable path)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run decode steps op by op instead of replaying captured CUDA graphs")
    group.add_argument("--gguf-weights", default="blocks", choices=GGUF_WEIGHTS,
                       help="how a GGUF file's quantized matrices are held on CPU: blocks (default: the file's own "
                            "bytes, read in place) or dequantized (to the compute dtype at load: about 3.5x the "
                            "memory, no decoding at batches of 9 or more rows)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length limit (default: the model's, capped to what the KV pool holds)")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"])
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--prefix-caching-hash-algo", default="xxh3_128", choices=["xxh3_128", "sha256"])
    group.add_argument("--kv-cache-dtype", default="auto",
                       choices=["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV: per-layer scales from the start-up calibration text instead of 1.0 (a checkpoint's "
                            "k_scale/v_scale win)")
    group.add_argument("--kv-offloading-size", type=float, default=None,
                       help="GiB of host memory that keeps blocks evicted from the pool, loaded back on a prefix hit")
    group.add_argument("--kv-offloading-backend", default="native", choices=["native"])
    group.add_argument("--kv-disk-path", default=None,
                       help="a folder for a disk tier below the host tier (kept across restarts)")
    group.add_argument("--kv-disk-size", type=float, default=10.0, help="GiB the disk tier may use (default 10)")
    group.add_argument("--kv-disk-save-timeout", type=float, default=30.0,
                       help="at shutdown, seconds to spend saving the pool's cached blocks to the disk tier; the "
                            "rest are recomputed after the restart (default 30; keep a pod's grace period above "
                            "--shutdown-timeout plus this)")
    group.add_argument("--kv-idle-offload-seconds", type=float, default=None,
                       help="move the blocks of sessions (OpenAI's user, or X-Session-ID) idle this long from the "
                            "pool to the KV tiers")
    group.add_argument("--kv-cache-memory", type=float, default=None,
                       help="GiB for the KV pool on CPU (default 1)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--num-gpu-blocks-override", type=int, default=None)
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        disable_cascade_attn=args.disable_cascade_attn,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        gguf_weights=args.gguf_weights,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            kv_offloading_size=args.kv_offloading_size,
            kv_offloading_backend=args.kv_offloading_backend,
            kv_disk_path=args.kv_disk_path,
            kv_disk_size=args.kv_disk_size,
            kv_disk_save_timeout=args.kv_disk_save_timeout,
            kv_idle_offload_seconds=args.kv_idle_offload_seconds,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            scheduling_policy=args.scheduling_policy,
        ),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
    )
    config.validate()
    return config
