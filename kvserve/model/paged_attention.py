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
import torch.nn.functional as F

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
    num_decodes = group.mask.shape[0]
    if group.contiguous_rows:
        start = int(group.token_indices[0])
        q_dec = q[start : start + num_decodes]
    else:
        q_dec = q.index_select(0, group.token_indices)
    kv_shape = (num_decodes, group.max_context_len, attn.num_kv_heads, attn.head_dim)
    keys = kv_cache.flat_key.index_select(0, group.context_slots).view(kv_shape).transpose(1, 2)
    values = kv_cache.flat_value.index_select(0, group.context_slots).view(kv_shape).transpose(1, 2)
    result = F.scaled_dot_product_attention(
        q_dec.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=group.mask, scale=attn.scale, enable_gqa=True
    )  # [num_decodes, heads, 1, head_dim]
    result = result.reshape(num_decodes, attn.num_heads * attn.head_dim)
    if group.contiguous_rows:
        out[start : start + num_decodes] = result
    else:
        out.index_copy_(0, group.token_indices, result)
