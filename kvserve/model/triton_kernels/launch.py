"""What the Triton kernels' launches share: a cache's format id and padded block sizes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model.triton_kernels.kv_formats import FP8_E4M3, FP8_E5M2, INT4, INT8, UNQUANTIZED

FORMAT_IDS = {None: UNQUANTIZED, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2, "int8": INT8, "int4": INT4}


def format_id(cache: LayerKVCache) -> int:
    return FORMAT_IDS[None if cache.codec is None else cache.codec.name]


def padded(n: int, minimum: int = 1) -> int:
    """The power of two a tile dimension of n elements takes (Triton's blocks are powers of two)."""
    return max(minimum, triton.next_power_of_2(n))


def kv_arguments(cache: LayerKVCache, head_dim: int) -> tuple[tuple, dict]:
    """The pool tensors a kernel reads (K, V, their scales, their per-tensor scales; the data tensor stands in
    for what the format lacks) and the format's constants (kv_formats.load_kv_tile's)."""
    def present(tensor):
        return cache.key if tensor is None else tensor

    pointers = (cache.key, cache.value, present(cache.key_scales), present(cache.value_scales),
                present(cache.key_tensor_scale), present(cache.value_tensor_scale))
    num_scales = cache.value_scales.shape[-1] if cache.value_scales is not None else 1
    return pointers, {"DATA_DIM": cache.key.shape[-1], "NUM_SCALES": num_scales, "FORMAT": format_id(cache)}


def dot_dtype(q: torch.Tensor):
    """The operand type of the kernels' tile products: fp32 under the interpreter (its bf16 products are wrong)
    and for fp32 models (exact products, not TF32), else the model's 16-bit type (tensor cores)."""
    if q.device.type != "cuda" or q.dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
