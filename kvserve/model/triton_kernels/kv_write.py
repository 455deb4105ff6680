"""Writing a step's new K/V into their pool slots, quantizing on the way (unquantized, fp8_e4m3, fp8_e5m2, int8),
bit for bit as the torch encoders of cache/storage/kv_quant.py. A slot of -1 is skipped: padded rows of a
replayed CUDA graph write nothing. int4 keys are requantized per block from their staging rows, which is the
torch writer's job (LayerKVCache.write), so int4 caches get no Triton writer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model.triton_kernels.kv_formats import encode_fp8, encode_scale_byte, round_half_even, scale_byte_value
from kvserve.model.triton_kernels.launch import format_id, padded

TOKENS_PER_PROGRAM = 8
# Elements of a program's [tokens, KV heads, head_dim] tile at most: 8 tokens x 32 KV heads x 128 took every
# register and spilled (fp8, fp32); 32 x 128 takes 2 tokens a program.
TILE_ELEMENTS = 8192


@triton.jit
def _write_vectors(source_ptr, slots_ptr, cache_ptr, scales_ptr, tensor_scale_ptr, num_tokens, num_kv_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, HEADS_PAD: tl.constexpr,
                   DIM_PAD: tl.constexpr, FORMAT: tl.constexpr):
    """BLOCK_T tokens' K (or V) vectors, every KV head, into their slots."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slots_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    vector_mask = (slots >= 0)[:, None] & (heads < num_kv_heads)[None, :]  # [T, H]
    mask = vector_mask[:, :, None] & (dims < HEAD_DIM)[None, None, :]
    elements = (heads * HEAD_DIM)[:, None] + dims[None, :]  # [H, D]
    source = source_ptr + (tokens.to(tl.int64) * num_kv_heads * HEAD_DIM)[:, None, None] + elements[None, :, :]
    x = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    target = cache_ptr + (slots * num_kv_heads * HEAD_DIM)[:, None, None] + elements[None, :, :]
    if FORMAT == 0:
        tl.store(target, x.to(cache_ptr.dtype.element_ty), mask=mask)
    elif FORMAT == 1 or FORMAT == 2:
        limit = 448.0 if FORMAT == 1 else 57344.0
        scaled = x * (1 / tl.load(tensor_scale_ptr))
        tl.store(target, encode_fp8(tl.minimum(tl.maximum(scaled, -limit), limit), FORMAT), mask=mask)
    else:  # int8: one scale byte per (token, head) vector
        scale_byte = encode_scale_byte(tl.max(tl.abs(x), axis=2) / 127)  # [T, H]
        quantized = round_half_even(x * (1 / scale_byte_value(scale_byte))[:, :, None])
        tl.store(target, tl.minimum(tl.maximum(quantized, -127.0), 127.0).to(tl.int8), mask=mask)
        tl.store(scales_ptr + (slots * num_kv_heads)[:, None] + heads[None, :], scale_byte, mask=vector_mask)


def write_kv(cache: LayerKVCache, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """key, value [tokens, kv_heads, head_dim] into `cache` at `slot_mapping` [tokens] (-1: skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fmt = format_id(cache)
    assert fmt != 4, "int4 caches are written by the torch writer (per-block key requantization)"
    block_t = max(1, min(TOKENS_PER_PROGRAM, TILE_ELEMENTS // (padded(num_kv_heads) * padded(head_dim))))
    for source, data, scales, tensor_scale in ((key, cache.key, cache.key_scales, cache.key_tensor_scale),
                                                (value, cache.value, cache.value_scales, cache.value_tensor_scale)):
        _write_vectors[(triton.cdiv(num_tokens, block_t),)](
            source.contiguous(), slot_mapping, data, data if scales is None else scales,
            data if tensor_scale is None else tensor_scale, num_tokens, num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_T=block_t, HEADS_PAD=padded(num_kv_heads), DIM_PAD=padded(head_dim), FORMAT=fmt)


def writer_for(cache: LayerKVCache):
    """LayerKVCache.writer for this cache, or None when its format is written by torch (int4)."""
    return None if format_id(cache) == 4 else _write


def _write(cache: LayerKVCache, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    write_kv(cache, slot_mapping, key, value)

