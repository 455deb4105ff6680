"""Decode attention over block tables, reading every KV format in place (flash-decoding).

One program per (sequence, KV head, split of the context) scores the GQA group's query heads together against
its part of the context and leaves a partial result: the unnormalised output, the running max and the sum of
exponentials. A merge program per (sequence, head) combines the parts. Long contexts thus spread over many
programs even at batch 1, and the number of splits depends only on the block tables' width, known on the host
(no device sync, and fixed inside a captured CUDA graph).

Shared prefixes (cascade attention, engine/shared_prefix.py): decodes whose block tables start with the same
blocks read those blocks once per step for up to MAX_SHARED_ROWS query rows of the group together (a tile
product), each member's own part after them as above; the shared parts' partials are merged with the own ones.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model.triton_kernels.launch import dot_dtype, kv_arguments, padded
from kvserve.model.triton_kernels.tiles import attend_tile, load_kv_tiles, online_softmax

BLOCK_TOKENS = 16  # context tokens a program reads per iteration on a GPU
INTERPRETED_BLOCK_TOKENS = 64  # under the interpreter, whose cost is per operation, not per element
SPLIT_TOKENS = 256  # a split covers at least this many context tokens
MAX_SPLITS = 32
MAX_SHARED_ROWS = 64  # query rows (members x heads of a group) one shared-prefix program scores at once
# fp32 models' exact tile products (FMA) spill 9-10 KB per thread at 64 rows: 16 rows over 8 warps spill nothing.
FP32_SHARED_ROWS, FP32_WARPS = 16, 8


@triton.jit
def _decode_parts(q_ptr, key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
                  value_tensor_scale_ptr, tables_ptr, context_lens_ptr, first_token_ptr, part_out_ptr,
                  part_max_ptr, part_sum_ptr, scale, sliding_window, tables_stride, block_size, num_kv_heads,
                  num_parts, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FORMAT: tl.constexpr,
                  HAS_FIRST_TOKEN: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = 0
    if HAS_FIRST_TOKEN:  # the tokens before it are a shared prefix, read by _decode_shared_parts
        start = tl.load(first_token_ptr + seq).to(tl.int32)
    start = tl.maximum(start, tl.where(sliding_window > 0, context_len - sliding_window, 0))
    per_split = tl.cdiv(tl.cdiv(context_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = start + split * per_split
    end = tl.minimum(start + per_split, context_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    q = tl.load(q_ptr + (seq * num_kv_heads * GROUP + heads)[:, None] * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < end
        keys, values = load_kv_tiles(key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
                                     value_tensor_scale_ptr, tables_ptr + seq * tables_stride, tokens, valid, kv_head,
                                     dims, block_size, num_kv_heads, DATA_DIM, NUM_SCALES, HEAD_DIM, FORMAT)
        # One query per head: products and sums, not tile products (too few rows for a GPU's matrix units).
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale
        running_max, probs, alpha, running_sum = online_softmax(tl.where(valid[None, :], scores, float("-inf")),
                                                                running_max, running_sum)
        acc = acc * alpha[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
    part = (seq * num_kv_heads * GROUP + heads) * num_parts + split
    tl.store(part_max_ptr + part, running_max, mask=row_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=row_mask)
    tl.store(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _decode_shared_parts(q_ptr, key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
                         value_tensor_scale_ptr, tables_ptr, members_ptr, shared_lens_ptr, part_out_ptr,
                         part_max_ptr, part_sum_ptr, scale, tables_stride, block_size, num_kv_heads, num_parts,
                         first_shared_part, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, DATA_DIM: tl.constexpr,
                         NUM_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One program: a chunk of up to MEMBERS members of one group (members_ptr row, -1 padded; the first is the
    one whose table is read), one KV head, one split of the shared tokens."""
    chunk = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, MEMBERS * GROUP_PAD)
    member = tl.load(members_ptr + chunk * MEMBERS + rows // GROUP_PAD)
    row_mask = (member >= 0) & (rows % GROUP_PAD < GROUP)
    seq = tl.where(row_mask, member, 0)
    reader = tl.load(members_ptr + chunk * MEMBERS)
    shared_len = tl.load(shared_lens_ptr + reader).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(shared_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, shared_len)

    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows % GROUP_PAD
    q = tl.load(q_ptr + (seq * num_kv_heads * GROUP + heads)[:, None] * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    q = (q * scale).to(DOT_DTYPE)
    running_max = tl.full([MEMBERS * GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([MEMBERS * GROUP_PAD], tl.float32)
    acc = tl.zeros([MEMBERS * GROUP_PAD, DIM_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < end
        keys, values = load_kv_tiles(key_ptr, value_ptr, key_scales_ptr, value_scales_ptr, key_tensor_scale_ptr,
                                     value_tensor_scale_ptr, tables_ptr + reader * tables_stride, tokens, valid,
                                     kv_head, dims, block_size, num_kv_heads, DATA_DIM, NUM_SCALES, HEAD_DIM, FORMAT)
        running_max, running_sum, acc = attend_tile(q, keys, values, valid[None, :], running_max, running_sum, acc,
                                                    DOT_DTYPE)
    part = (seq * num_kv_heads * GROUP + heads) * num_parts + first_shared_part + split
    tl.store(part_max_ptr + part, running_max, mask=row_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=row_mask)
    tl.store(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _merge_parts(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_parts, HEAD_DIM: tl.constexpr,
                 DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr):
    """out[seq, head] from its parts; a part that read nothing has max -inf and weighs 0, and a sequence that
    read nothing (a padded row) gets zeros."""
    row = tl.program_id(0)  # seq * num_heads + head
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, DIM_PAD)
    present = parts < num_parts
    part_max = tl.load(part_max_ptr + row * num_parts + parts, mask=present, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + row * num_parts + parts, mask=present, other=0.0)
    acc = tl.load(part_out_ptr + (row * num_parts + parts)[:, None] * DIM_PAD + dims[None, :],
                  mask=present[:, None], other=0.0)
    top = tl.max(part_max, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(part_max == float("-inf"), 0.0, tl.exp(part_max - top))
    total = tl.sum(part_sum * weight, axis=0)
    # Parts nobody wrote (a decode outside any shared group has no shared parts) hold garbage: never multiplied.
    weighted = tl.where(weight[:, None] > 0, acc * weight[:, None], 0.0)
    out = tl.sum(weighted, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Splits of each context: enough programs to fill a GPU at small batches, each at least SPLIT_TOKENS long."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting only adds work
    by_length = triton.cdiv(max_context_len, SPLIT_TOKENS)
    by_occupancy = triton.cdiv(4 * _multiprocessors(device.index), num_seqs * num_kv_heads)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_attention(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, sliding_window: int, shared_prefixes: tuple[torch.Tensor, torch.Tensor] | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] against each sequence's first `context_lens` tokens through its block
    table row -> [num_seqs, num_heads * head_dim] in q's dtype. `sliding_window` 0: none. `shared_prefixes`: the
    CPU kernel's (tokens each decode's group reads once, its group's first member), host tensors. A context
    length of 0 (a padded row) gives zeros."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache.key.shape
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    exact = q.device.type == "cuda" and q.dtype == torch.float32  # dot_dtype's fp32 tile products
    shared = None if shared_prefixes is None else _shared_chunks(
        shared_prefixes, group, q.device, FP32_SHARED_ROWS if exact else MAX_SHARED_ROWS)
    shared_splits = 0 if shared is None else shared[2]
    num_parts = num_splits + shared_splits
    dim_pad = padded(head_dim, 16)
    block_n = BLOCK_TOKENS if q.device.type == "cuda" else INTERPRETED_BLOCK_TOKENS
    part_out = torch.empty(num_seqs * num_heads * num_parts * dim_pad, dtype=torch.float32, device=q.device)
    part_max = torch.full((num_seqs * num_heads * num_parts,), float("-inf"), dtype=torch.float32, device=q.device)
    part_sum = torch.zeros(num_seqs * num_heads * num_parts, dtype=torch.float32, device=q.device)
    out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = q.contiguous()
    kv, meta = kv_arguments(cache, head_dim)
    first_token = context_lens if shared is None else shared[1]
    _decode_parts[(num_seqs, num_kv_heads, num_splits)](
        q, *kv, block_tables, context_lens, first_token, part_out, part_max, part_sum, scale, sliding_window,
        block_tables.stride(0), block_size, num_kv_heads, num_parts, GROUP=group, GROUP_PAD=padded(group),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, **meta, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_FIRST_TOKEN=shared is not None)
    if shared is not None:
        members, shared_lens, splits, members_per_chunk = shared
        assert sliding_window == 0, "shared prefixes are not read under a sliding window"
        _decode_shared_parts[(members.shape[0], num_kv_heads, splits)](
            q, *kv, block_tables, members, shared_lens, part_out, part_max, part_sum, scale,
            block_tables.stride(0), block_size, num_kv_heads, num_parts, num_splits, GROUP=group,
            GROUP_PAD=padded(group), MEMBERS=members_per_chunk, HEAD_DIM=head_dim, DIM_PAD=dim_pad, **meta,
            BLOCK_N=block_n, NUM_SPLITS=splits, DOT_DTYPE=dot_dtype(q), num_warps=FP32_WARPS if exact else 4)
    _merge_parts[(num_seqs * num_heads,)](part_out, part_max, part_sum, out, num_parts, HEAD_DIM=head_dim,
                                          DIM_PAD=dim_pad, PARTS_PAD=padded(num_parts))
    return out


def _shared_chunks(shared_prefixes: tuple[torch.Tensor, torch.Tensor], group: int, device: torch.device,
                   max_rows: int = MAX_SHARED_ROWS):
    """(members [chunks, M] int64 -1-padded, each chunk's reader first; each decode's shared tokens [num_seqs] on
    the device; splits of the longest shared prefix; M), or None when no decode shares."""
    lens, leaders = (t.tolist() for t in shared_prefixes)
    members_per_chunk = max(1, max_rows // padded(group))
    by_leader: dict[int, list[int]] = {}
    for seq, (length, leader) in enumerate(zip(lens, leaders)):
        if length > 0:
            by_leader.setdefault(leader, []).append(seq)
    if not by_leader:
        return None
    chunks = []
    for members in by_leader.values():
        for start in range(0, len(members), members_per_chunk):
            part = members[start:start + members_per_chunk]
            chunks.append(part + [-1] * (members_per_chunk - len(part)))
    splits = max(1, min(triton.cdiv(max(lens), SPLIT_TOKENS), MAX_SPLITS)) if device.type == "cuda" else 1
    return (torch.tensor(chunks, dtype=torch.int64, device=device),
            torch.tensor(lens, dtype=torch.int64, device=device), splits, members_per_chunk)
