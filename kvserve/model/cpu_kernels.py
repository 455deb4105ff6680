"""Optional C++ kernels for CPUs, compiled on first use with torch's extension builder (needs a C++ compiler
and ninja), once per ISA family (kvserve/model/cpu_isa.py): the module's name carries the family, so each
family has its own entry in torch's extension cache. Everything here has a portable torch fallback: if the
build fails, kvserve logs why and runs the portable path, never fails.

Set KVSERVE_CPU_KERNELS=0 to force the portable path, KVSERVE_CPU_ISA=avx2 (etc.) to cap the family.
"""

from __future__ import annotations

import fcntl
import logging
import os
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from kvserve.cache.kv_storage import LayerKVCache
from kvserve.model.cpu_isa import CpuIsa, selected_isa

logger = logging.getLogger("kvserve.model")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "prefill_attention.cpp", "prefill_attention_fp32.cpp",
                                    "kv_quantize.cpp", "small_batch_linear.cpp", "quant_linear.cpp", "argmax.cpp")]


def cpu_kernels(isa: CpuIsa | None = None):
    """The compiled module for `isa` (default: the selected family), or None when it cannot be built or
    KVSERVE_CPU_KERNELS=0. Which prefill kernels it has depends on the family: see `prefill_kernel`."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    return _build(isa or selected_isa())


# The kernels' ids of the quantized formats (kv_dequant.h's kvq::Format).
QUANTIZED_FORMAT_IDS = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3, "int4": 4}

# Caches the kernels read under a model dtype besides its own: an fp32 model's 16-bit cache, widened on load.
READABLE_CACHE_DTYPES = {torch.float32: (torch.float32, torch.bfloat16, torch.float16)}


def prefill_kernel(kernels, dtype: torch.dtype, head_dim: int, cache: LayerKVCache):
    """The prefill attention for this model dtype, head size and cache, as
    `fn(q, cache, block_tables, query_starts, num_past, scale, sliding_window, out)`; None: the portable path."""
    if kernels is None:
        return None
    bf16 = dtype == torch.bfloat16 and kernels.has_prefill_attention_bf16() and head_dim % 64 == 0
    multiple = kernels.prefill_attention_fp32_head_dim_multiple()
    fp32 = dtype == torch.float32 and multiple and head_dim % multiple == 0
    if cache.quantized:
        if bf16:
            return _quantized(kernels.paged_prefill_attention_bf16_quantized)
        return _quantized(kernels.paged_prefill_attention_fp32_quantized) if fp32 else None
    if bf16 and cache.key.dtype == torch.bfloat16:
        return _unquantized(kernels.paged_prefill_attention_bf16)
    if fp32 and cache.key.dtype in READABLE_CACHE_DTYPES[dtype]:
        return _unquantized(kernels.paged_prefill_attention_fp32)
    return None


def decode_kernel(kernels, dtype: torch.dtype, cache: LayerKVCache):
    """The decode attention when it reads this cache under this model dtype, as
    `fn(q, cache, block_tables, context_lens, scale, sliding_window) -> out`; None: the portable path."""
    if kernels is None:
        return None
    if cache.quantized:
        return _quantized(kernels.paged_decode_attention_quantized)
    if cache.key.dtype != dtype and cache.key.dtype not in READABLE_CACHE_DTYPES.get(dtype, ()):
        return None
    return _unquantized(kernels.paged_decode_attention)


def kv_writer(kernels, cache: LayerKVCache):
    """`fn(cache, slot_mapping, key, value)` writing new K/V into the cache in one call (for a quantized cache
    bit-identical to kv_quant's torch encoders), or None: torch's ops write them."""
    if kernels is None or cache.key.device.type != "cpu":
        return None

    def write_quantized(target: LayerKVCache, slot_mapping, key, value) -> None:
        if target.keys_per_block:  # write_quantized_kv writes int4's values only
            kernels.write_int4_keys(key, target.key_staging.plan(slot_mapping), target.key, target.key_scales,
                                    target.key_stage)
        kernels.write_quantized_kv(key, value, slot_mapping, target.key, target.value, *_scale_args(target))

    def write(target: LayerKVCache, slot_mapping, key, value) -> None:
        kernels.write_kv(key, value, slot_mapping, target.key, target.value)

    return write_quantized if cache.quantized else write


def _scale_args(cache: LayerKVCache) -> tuple:
    """The cache's scales as the kernels take them: per-vector scales (or an empty tensor), per-tensor scales,
    the format id."""
    return (_NO_SCALES if cache.key_scales is None else cache.key_scales,
            _NO_SCALES if cache.value_scales is None else cache.value_scales,
            1.0 if cache.key_tensor_scale is None else float(cache.key_tensor_scale),
            1.0 if cache.value_tensor_scale is None else float(cache.value_tensor_scale),
            QUANTIZED_FORMAT_IDS[cache.codec.name])


def _unquantized(kernel):
    def call(q, cache: LayerKVCache, *args):
        return kernel(q, cache.key, cache.value, *args)
    return call


_NO_SCALES = torch.empty(0, dtype=torch.float16)


def _quantized(kernel):
    def call(q, cache: LayerKVCache, *args):
        return kernel(q, cache.key, cache.value, *_scale_args(cache), *args)
    return call


def module_name(isa: CpuIsa) -> str:
    return f"kvserve_cpu_kernels_{isa.name}"


@cache
def _build(isa: CpuIsa):
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = module_name(isa)
        build_dir = Path(_get_build_directory(name, verbose=False))
        if not any(build_dir.glob(f"{name}*.so")):
            logger.info("Building the CPU kernels for %s (once per CPU family, about 30-60 s; cached in %s)",
                        isa.label, build_dir)
        with _exclusive_build(build_dir):
            return load(
                name=name,
                sources=[str(source) for source in SOURCES],
                # The family's flags, not -march=native: the cache entry must run on every CPU of the family.
                # -fopenmp: at::parallel_for is header code that runs serially unless OpenMP is on at compile
                # time.
                extra_cflags=["-O3", "-ffast-math", "-fopenmp", *isa.compile_flags],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC)],
                verbose=False,
            )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("CPU kernels for %s unavailable (%s); using the portable torch path", isa.label, exc)
        return None


@contextmanager
def _exclusive_build(build_dir: Path):
    """Holds an flock on the build folder while torch builds or loads the module there.

    torch's own lock is a plain file that a build killed mid-way leaves behind, and every later start then
    waits on it forever. An flock dies with its process, so whoever holds it knows any torch lock file it
    finds is stale, and removes it."""
    with open(build_dir / "kvserve-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink()
        yield
