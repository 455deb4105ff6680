"""What the attention kernels do per tile of context: read its K and V through a block table row, and fold it into
an online softmax (FlashAttention's running max, sum and unnormalised output)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.model.triton_kernels.kv_formats import load_kv_tile


@triton.jit
def load_kv_tiles(key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr, value_tensor_scale_ptr,
                  table_row_ptr, tokens, valid, kv_head, dims, block_size, num_kv_heads, DATA_DIM: tl.constexpr,
                  NUM_SCALES: tl.constexpr, HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr):
    """K and V of a sequence's context positions `tokens` [N] (its block table row at table_row_ptr), fp32 [N, D]."""
    blocks = tl.load(table_row_ptr + tokens // block_size, mask=valid, other=0)
    slots = blocks * block_size + tokens % block_size
    keys = load_kv_tile(key_ptr, key_scales_ptr, key_tensor_scale_ptr, slots, kv_head, dims, valid, block_size,
                        num_kv_heads, DATA_DIM, NUM_SCALES, HEAD_DIM, FORMAT, True)
    values = load_kv_tile(value_ptr, value_scales_ptr, value_tensor_scale_ptr, slots, kv_head, dims, valid,
                          block_size, num_kv_heads, DATA_DIM, NUM_SCALES, HEAD_DIM, FORMAT, False)
    return keys, values


@triton.jit
def attend_tile(q, keys, values, visible, running_max, running_sum, acc, DOT_DTYPE: tl.constexpr):
    """Folds one tile into the running state with tile products: q [R, D] already scaled, in DOT_DTYPE; keys and
    values [N, D] fp32; visible [R, N]. A row that has seen nothing yet keeps max -inf and zeros."""
    scores = tl.dot(q, tl.trans(keys.to(DOT_DTYPE)), input_precision="ieee")
    new_max, probs, alpha, running_sum = online_softmax(tl.where(visible, scores, float("-inf")), running_max,
                                                        running_sum)
    acc = acc * alpha[:, None] + tl.dot(probs.to(DOT_DTYPE), values.to(DOT_DTYPE), input_precision="ieee")
    return new_max, running_sum, acc


@triton.jit
def online_softmax(scores, running_max, running_sum):
    """A tile's scores [R, N] (masked ones -inf) against the running max and sum: (the new max, the tile's
    probabilities under it, the factor rescaling what came before, the new sum). A row that has seen nothing
    yet keeps max -inf and weighs nothing."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    base = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp(scores - base[:, None])
    alpha = tl.exp(running_max - base)
    return new_max, probs, alpha, running_sum * alpha + tl.sum(probs, axis=1)
