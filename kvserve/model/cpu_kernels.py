"""Optional C++ kernels for CPUs, compiled when kvserve installs (setup.py; kvserve/model/kernel_build.py), one
module per ISA family (kvserve/model/cpu_isa.py). Runtime only loads the selected family's module, never
compiles: a family the install could not build, or built from other sources or for another torch, is named
in the start-up log and the portable torch path runs instead.

Set KVSERVE_CPU_KERNELS=0 to force the portable path, KVSERVE_CPU_ISA=avx2 (etc.) to cap the family.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from functools import cache
from pathlib import Path

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model import kernel_build
from kvserve.model.cpu_isa import CpuIsa, has_amx_bf16, selected_isa
from kvserve.model.layers import onednn_packs

logger = logging.getLogger("kvserve.model")


def cpu_kernels(isa: CpuIsa | None = None):
    """The installed module for `isa` (default: the selected family), or None when the install has none that
    fits (the log says why) or KVSERVE_CPU_KERNELS=0. Which prefill kernels it has depends on the family: see `prefill_kernel`."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    return _load(isa or selected_isa())


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


def packed_weights_are_faster(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether bf16 matmul weights are held in oneDNN's blocked layout alone instead of as plain rows: on a CPU with
    AMX oneDNN's matmuls over it were the fastest at every batch size, one row (its GEMV) to a prefill (plain
    rows through AMX tiles 0.86-0.92x at 3-48 rows, through torch's matmul 0.71-0.80x past them; benchmarks/
    dense_weights.py). Elsewhere plain rows: small_batch_linear's walk beat oneDNN's GEMV 1.4x on Zen 4."""
    return dtype == torch.bfloat16 and has_amx_bf16(flags) and onednn_packs(dtype)


def decode_kernel(kernels, dtype: torch.dtype, cache: LayerKVCache):
    """The decode attention when it reads this cache under this model dtype, as
    `fn(q, cache, block_tables, context_lens, scale, sliding_window, shared_prefixes=None) -> out` (shared_prefixes:
    DecodeGroup's); None: the portable path."""
    if kernels is None:
        return None
    if cache.quantized:
        return _with_shared_prefixes(_quantized(kernels.paged_decode_attention_quantized))
    if cache.key.dtype != dtype and cache.key.dtype not in READABLE_CACHE_DTYPES.get(dtype, ()):
        return None
    return _with_shared_prefixes(_unquantized(kernels.paged_decode_attention))


_NO_SHARED_PREFIXES = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))


def _with_shared_prefixes(kernel):
    def call(q, cache: LayerKVCache, block_tables, context_lens, scale, sliding_window, shared_prefixes=None):
        return kernel(q, cache, block_tables, context_lens, scale, sliding_window,
                      *(shared_prefixes or _NO_SHARED_PREFIXES))
    return call


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


@cache
def _load(isa: CpuIsa):
    kernels, problem = load_installed(isa)
    if problem:
        logger.warning("CPU kernels for %s unavailable: %s; using the portable torch path. To build them, %s",
                       isa.label, problem, kernel_build.REBUILD_HINT)
    return kernels


def load_installed(isa: CpuIsa, folder: Path | None = None):
    """(the module the install built for `isa` in `folder`, None) or (None, why it is not loaded)."""
    folder = folder or kernel_build.KERNELS_DIR
    problem = kernel_build.install_problem(isa, torch.__version__, folder)
    if problem:
        return None, problem
    name = kernel_build.module_name(isa)
    if name in sys.modules:
        return sys.modules[name], None
    spec = importlib.util.spec_from_file_location(name, kernel_build.module_file(isa, folder))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. a libstdc++ older than the one it was built with
        return None, f"its module does not load ({exc})"
    sys.modules[name] = module
    return module, None
