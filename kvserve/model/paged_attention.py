"""Portable attention over the paged KV cache (torch ops only; runs on CPU and CUDA).

Per layer: first every new token's K/V is written into its slot, then attention reads context through the
slots. Writing first is what lets a request read blocks that another request of the same step is filling
(prefix-cache hits within one step) and lets a chunked prefill see its earlier chunks.

Decodes (one new token per sequence) are batched into one SDPA call over a padded context gathered with one
index_select; the gather indices and masks are built once per step by the runner and shared by all layers.
Prefills with no cached past attend over their own new K/V directly (no cache read at all); prefills that
continue a cached past gather their context from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.cache.kv_storage import LayerKVCache


@dataclass(slots=True)
class PrefillSegment:
    token_start: int  # this sequence's new tokens are batch rows [token_start, token_end)
    token_end: int
    num_past_tokens: int  # tokens already in the cache before this step
    context_slots: torch.Tensor | None  # slots of the whole context (past + new); None when num_past_tokens == 0


@dataclass(slots=True)
class DecodeGroup:
    token_indices: torch.Tensor  # [num_decodes] batch rows of the decoding sequences' new tokens
    context_slots: torch.Tensor  # [num_decodes * max_context_len] slots, padded with slot 0
    mask: torch.Tensor  # [num_decodes, 1, 1, max_context_len] True where a key may be attended
    max_context_len: int
    contiguous_rows: bool  # token_indices is range(start, start + num_decodes): slice instead of gather


@dataclass(slots=True)
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    decode: DecodeGroup | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)


def paged_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, metadata) -> torch.Tensor:
    paged: PagedAttentionMetadata = metadata.paged
    kv_cache.write(paged.slot_mapping, k, v)
    out = q.new_empty(q.shape[0], attn.num_heads * attn.head_dim)
    if paged.decode is not None:
        _decode(attn, q, kv_cache, paged.decode, out)
    for segment in paged.prefills:
        rows = slice(segment.token_start, segment.token_end)
        if segment.context_slots is None:
            out[rows] = attn.attend(q[rows], k[rows], v[rows], num_past_tokens=0)
        else:
            keys = kv_cache.flat_key.index_select(0, segment.context_slots).to(q.dtype)
            values = kv_cache.flat_value.index_select(0, segment.context_slots).to(q.dtype)
            out[rows] = attn.attend(q[rows], keys, values, num_past_tokens=segment.num_past_tokens)
    return out


def _decode(attn, q: torch.Tensor, kv_cache: LayerKVCache, group: DecodeGroup, out: torch.Tensor) -> None:
    """One query per sequence against its padded context, as two batched matmuls.

    Not SDPA: torch's CPU flash kernel is built for long queries and is ~8x slower for one query per sequence.
    Query heads are grouped under their KV head (GQA) so K/V are never repeated. Scores are computed in fp32
    (QK^T is where low precision hurts); probabilities x V runs in the model dtype with fp32 accumulation.
    """
    num_decodes, max_len = group.mask.shape[0], group.max_context_len
    group_size = attn.num_heads // attn.num_kv_heads
    if group.contiguous_rows:
        start = int(group.token_indices[0])
        q_dec = q[start : start + num_decodes]
    else:
        q_dec = q.index_select(0, group.token_indices)
    kv_shape = (num_decodes, max_len, attn.num_kv_heads, attn.head_dim)
    # Gather then make head-major [seqs, kv_heads, context, head_dim] so each matmul operand is contiguous.
    keys = kv_cache.flat_key.index_select(0, group.context_slots).view(kv_shape).transpose(1, 2).to(torch.float32)
    values = kv_cache.flat_value.index_select(0, group.context_slots).view(kv_shape).transpose(1, 2)
    values = values.to(q.dtype).contiguous()
    queries = q_dec.view(num_decodes, attn.num_kv_heads, group_size, attn.head_dim).to(torch.float32)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(attn.scale)  # [seqs, kv_heads, group, context]
    scores.masked_fill_(~group.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    result = torch.matmul(probs, values).reshape(num_decodes, attn.num_heads * attn.head_dim)
    if group.contiguous_rows:
        out[start : start + num_decodes] = result
    else:
        out.index_copy_(0, group.token_indices, result)
