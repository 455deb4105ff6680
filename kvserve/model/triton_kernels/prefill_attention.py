"""Prefill (extend) attention: each prefilling sequence's new queries, causal, over its whole context read in place
through its block table, every KV format. A chunk of a long prompt and a prompt after a prefix hit read their
cached past where it lies; nothing is gathered.

One program per (tile of a sequence's queries, KV head): its rows are BLOCK_Q queries x the GQA group's heads,
so each K/V tile is read once for the group, and scored with tile products (online softmax, as FlashAttention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model.triton_kernels.launch import dot_dtype, kv_arguments, padded
from kvserve.model.triton_kernels.tiles import attend_tile, load_kv_tiles

# Query rows (queries x heads of a group) a program scores, and keys it reads per iteration: on a GPU, and
# under the interpreter (whose cost is per operation, not per element).
TILE_ROWS, BLOCK_KEYS = 64, 32
# fp32 models' tile products are exact (FMA, not tensor cores), whose operands take far more registers: at the
# tiles above ptxas spills 15-21 KB per thread at head_dim 128; 16 rows x 16 keys over 8 warps spill nothing.
FP32_TILE_ROWS, FP32_BLOCK_KEYS, FP32_WARPS = 16, 16, 8
INTERPRETED_TILE_ROWS, INTERPRETED_BLOCK_KEYS = 128, 64


@triton.jit
def _prefill(q_ptr, key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
             value_tensor_scale_ptr, out_ptr, tables_ptr, query_starts_ptr, num_past_ptr, tile_seqs_ptr,
             tile_queries_ptr, scale, sliding_window, tables_stride, block_size, num_kv_heads,
             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
             DIM_PAD: tl.constexpr, DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
             FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile)
    first_query = tl.load(tile_queries_ptr + tile).to(tl.int32)
    row_start = tl.load(query_starts_ptr + seq).to(tl.int32)
    num_queries = tl.load(query_starts_ptr + seq + 1).to(tl.int32) - row_start
    num_past = tl.load(num_past_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = first_query + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (query < num_queries) & (rows % GROUP_PAD < GROUP)
    position = num_past + query
    dims = tl.arange(0, DIM_PAD)
    q_offsets = ((row_start + query) * num_kv_heads * GROUP + head)[:, None] * HEAD_DIM + dims[None, :]
    q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    q = (q * scale).to(DOT_DTYPE)

    last_position = num_past + tl.minimum(first_query + BLOCK_Q, num_queries) - 1
    # Branch-free windows (0: none), so every variable keeps one type whatever the runtime value.
    start = tl.where(sliding_window > 0, tl.maximum(num_past + first_query - sliding_window + 1, 0), 0)
    running_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    for key_tile in range(start, last_position + 1, BLOCK_N):
        keys_at = key_tile + tl.arange(0, BLOCK_N)
        valid = keys_at <= last_position
        keys, values = load_kv_tiles(key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
                                     value_tensor_scale_ptr, tables_ptr + seq * tables_stride, keys_at, valid,
                                     kv_head, dims, block_size, num_kv_heads, DATA_DIM, NUM_SCALES, HEAD_DIM, FORMAT)
        visible = (keys_at[None, :] <= position[:, None]) & valid[None, :] & row_mask[:, None]
        visible = visible & ((keys_at[None, :] > position[:, None] - sliding_window) | (sliding_window <= 0))
        running_max, running_sum, acc = attend_tile(q, keys, values, visible, running_max, running_sum, acc,
                                                    DOT_DTYPE)
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tiles(query_starts: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """The programs' (sequence, first query) pairs: each sequence's new queries in tiles of block_q."""
    seqs, firsts = [], []
    for seq in range(len(query_starts) - 1):
        for first in range(0, query_starts[seq + 1] - query_starts[seq], block_q):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def prefill_attention(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, query_starts: torch.Tensor,
                      num_past: torch.Tensor, scale: float, sliding_window: int, out: torch.Tensor) -> None:
    """q [num_tokens, num_heads, head_dim]; sequence s's new queries are rows [query_starts[s], query_starts[s +
    1]) and follow its `num_past[s]` cached tokens; its context is read through block_tables[s] (its new K/V are
    already in the cache). Writes those rows of out [num_tokens, num_heads * head_dim] (the CPU kernel's
    interface: query_starts and num_past may be host tensors)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = cache.key.shape
    group = num_heads // num_kv_heads
    group_pad = padded(group)
    on_gpu = q.device.type == "cuda"
    exact = on_gpu and q.dtype == torch.float32  # dot_dtype's fp32 tile products
    tile_rows = FP32_TILE_ROWS if exact else TILE_ROWS if on_gpu else INTERPRETED_TILE_ROWS
    block_q = max(1, tile_rows // group_pad)
    seqs, firsts = prefill_tiles(query_starts.tolist(), block_q)
    if not seqs:
        return
    device = q.device
    kv, meta = kv_arguments(cache, head_dim)
    _prefill[(len(seqs), num_kv_heads)](
        q.contiguous(), *kv, out, block_tables, query_starts.to(device), num_past.to(device),
        torch.tensor(seqs, dtype=torch.int64, device=device), torch.tensor(firsts, dtype=torch.int64, device=device),
        scale, sliding_window, block_tables.stride(0), block_size, num_kv_heads, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, HEAD_DIM=head_dim, DIM_PAD=padded(head_dim, 16), **meta,
        BLOCK_N=FP32_BLOCK_KEYS if exact else BLOCK_KEYS if on_gpu else INTERPRETED_BLOCK_KEYS,
        DOT_DTYPE=dot_dtype(q), num_warps=FP32_WARPS if exact else 4)
