"""Attention over the paged KV cache.

Per layer: first every new token's K/V is written into its slot, then attention reads context through the
block tables. Writing first is what lets a request read blocks that another request of the same step is
filling (prefix-cache hits within one step) and lets a chunked prefill see its earlier chunks.

On CPU, when the C++ kernels build (kvserve/model/cpu_kernels.py), both kinds of rows read K/V in place
through the block tables: decodes (one new token per sequence) in one kernel call per layer, and every prefill
segment of the step in another (bf16 on CPUs with AVX512-BF16, fp32 on AVX2 or AVX-512; 4-6x torch's flash
kernel at 400 tokens). The model runner picks the kernels once and hands them over in the metadata.
The portable torch path (CUDA, other dtypes, a CPU without a compiler) batches decodes into two matmuls over a
padded context gathered with one index_select per layer (indices built once per step), in chunks of sequences
so the gathered copy stays under a bound the engine's memory profile covers; it runs each prefill through
SDPA: over its own new K/V when it has no cached past, over a context gathered from the cache when it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache


@dataclass(slots=True)
class PrefillSegment:
    token_start: int  # this sequence's new tokens are batch rows [token_start, token_end)
    token_end: int
    num_past_tokens: int  # tokens already in the cache before this step
    context_slots: torch.Tensor | None  # slots of the whole context (past + new); None when num_past_tokens == 0


@dataclass(slots=True)
class PrefillGroup:
    """The step's prefilling sequences, which occupy batch rows [num_decodes, num_tokens).

    Either the kernel's inputs (it reads each sequence's whole context through its block table) or, for the
    portable path, one segment per sequence with its rows and gathered context slots.
    """

    segments: list[PrefillSegment]  # empty when the kernel runs
    kernel_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # block tables, query starts, num past
    kernel: Callable | None = None  # the CPU prefill kernel for the model's dtype (cpu_kernels.prefill_kernel)


@dataclass(slots=True)
class DecodeGroup:
    """The step's decoding sequences (one new token each), which occupy batch rows [0, num_decodes)."""

    block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_decodes] int64, including the new token
    max_context_len: int  # max(context_lens), from the host: reading a CUDA tensor would sync mid-forward
    block_size: int
    # The compiled CPU kernel (paged_decode_attention) that reads blocks in place; None: the portable gather path.
    kernel: Callable | None = None
    # The portable path gathers at most this many padded context tokens per layer at once (whole sequences, at
    # least one), so its transient copy is bounded whatever the batch; None: every sequence at once.
    max_gather_tokens: int | None = None
    # Groups of decodes whose leading blocks are the same (engine/shared_prefix.py), as the kernel takes them:
    # (tokens each reads once for its whole group [num_decodes], its group's first member [num_decodes]); None:
    # every decode reads its own context.
    shared_prefixes: tuple[torch.Tensor, torch.Tensor] | None = None
    # A single chunk's gather plan, built on first use and shared by every layer of the step.
    _gather: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_decodes(self) -> int:
        return self.context_lens.shape[0]

    @property
    def rows_per_gather(self) -> int:
        if self.max_gather_tokens is None:
            return self.num_decodes
        return max(1, self.max_gather_tokens // self.max_context_len)

    def gather_chunks(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Per chunk of at most rows_per_gather sequences: (its rows, context slots [rows, max_len] padded with
        slot 0, mask [rows, 1, 1, max_len] of each context's tokens; a layer's window is its own). One chunk's plan is built once and shared by every layer; when the
        batch needs several, each is rebuilt per layer, so at most one chunk's plan is alive at a time."""
        rows = self.rows_per_gather
        if rows >= self.num_decodes:
            if self._gather is None:
                self._gather = self._plan(slice(0, self.num_decodes))
            yield slice(0, self.num_decodes), *self._gather
            return
        for start in range(0, self.num_decodes, rows):
            chunk = slice(start, start + rows)
            yield chunk, *self._plan(chunk)

    def _plan(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        max_len = self.max_context_len
        device = self.block_tables.device
        offsets = torch.arange(self.block_size, device=device)
        slots = (self.block_tables[rows].unsqueeze(2) * self.block_size + offsets).flatten(1)[:, :max_len]
        key_pos = torch.arange(max_len, device=device).unsqueeze(0)
        lengths = self.context_lens[rows].unsqueeze(1)
        mask = key_pos < lengths
        slots = slots.masked_fill(~mask, 0)
        return slots, mask.view(slots.shape[0], 1, 1, max_len)

    def window_mask(self, rows: slice, window: int) -> torch.Tensor:
        """[rows, 1, 1, max_len]: the keys inside each sequence's last `window` positions."""
        key_pos = torch.arange(self.max_context_len, device=self.context_lens.device).unsqueeze(0)
        inside = key_pos > self.context_lens[rows].unsqueeze(1) - 1 - window
        return inside.view(inside.shape[0], 1, 1, -1)


@dataclass(slots=True)
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    decode: DecodeGroup | None = None
    prefill: PrefillGroup | None = None


def paged_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, metadata) -> torch.Tensor:
    paged: PagedAttentionMetadata = metadata.paged
    if isinstance(paged, tuple):  # one per KV cache group (a model mixing attention kinds): the layer's group's
        paged = paged[kv_cache.group]
    if kv_cache.key_offset_channels is not None:  # the start-up calibration's forward
        kv_cache.measure_key_offset(k)
    if kv_cache.key_offset is not None:  # every score of a query moves by q . offset alike: softmax ignores it
        k = k - kv_cache.key_offset
    rotation = kv_cache.rotation
    if rotation is not None:  # a rotating format (int4): q.k is unchanged, the output is rotated back below
        q, k, v = _rotate(q, rotation), _rotate(k, rotation), _rotate(v, rotation)
    kv_cache.write(paged.slot_mapping, k, v)
    out = q.new_empty(q.shape[0], attn.num_heads * attn.head_dim)
    if paged.decode is not None:
        _decode(attn, q, kv_cache, paged.decode, out)
    if paged.prefill is not None:
        _prefill(attn, q, k, v, kv_cache, paged.prefill, paged.slot_mapping, out)
    if rotation is not None:
        out = _rotate(out.view(q.shape[0], attn.num_heads, attn.head_dim), rotation.T).view(q.shape[0], -1)
    return out


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] times an orthogonal [head_dim, head_dim] matrix, in fp32, back in x's dtype."""
    return torch.matmul(x.to(torch.float32), rotation).to(x.dtype)


def _prefill(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, group: PrefillGroup,
             slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
    if group.kernel is not None:
        block_tables, query_starts, num_past = group.kernel_inputs
        group.kernel(q, kv_cache, block_tables, query_starts, num_past, attn.scale, attn.sliding_window or 0, out)
        return
    for segment in group.segments:
        rows = slice(segment.token_start, segment.token_end)
        context_slots = segment.context_slots
        if context_slots is None and kv_cache.quantized:
            # A quantized cache is read back even without a past, so a prompt attends to the same K/V whether
            # its prefix was computed this step or found in the cache.
            context_slots = slot_mapping[rows]
        if context_slots is None:
            out[rows] = attn.attend(q[rows], k[rows], v[rows], num_past_tokens=0)
        else:
            keys, values = kv_cache.gather(context_slots, q.dtype)
            out[rows] = attn.attend(q[rows], keys, values, num_past_tokens=segment.num_past_tokens)


def _decode(attn, q: torch.Tensor, kv_cache: LayerKVCache, group: DecodeGroup, out: torch.Tensor) -> None:
    num_decodes = group.num_decodes
    q_dec = q[:num_decodes]
    if group.kernel is not None:
        window = attn.sliding_window
        shared = group.shared_prefixes if window is None else None  # shared parts are read without a window
        result = group.kernel(q_dec.contiguous(), kv_cache, group.block_tables, group.context_lens, attn.scale,
                              window or 0, shared)
        out[:num_decodes] = result.view(num_decodes, -1)
        return
    out[:num_decodes] = _decode_portable(attn, q_dec, kv_cache, group)


def _decode_portable(attn, q_dec: torch.Tensor, kv_cache: LayerKVCache, group: DecodeGroup) -> torch.Tensor:
    """One query per sequence against its padded context, as two batched matmuls per chunk of sequences.

    Not SDPA: torch's CPU flash kernel is built for long queries and is several times slower for one query per
    sequence. Query heads are grouped under their KV head (GQA) so K/V are never repeated.
    """
    window = attn.sliding_window
    outputs = [_attend_padded(attn, q_dec[rows], kv_cache, slots,
                              mask if window is None else mask & group.window_mask(rows, window))
               for rows, slots, mask in group.gather_chunks()]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _attend_padded(attn, q_dec: torch.Tensor, kv_cache: LayerKVCache, slots: torch.Tensor, mask: torch.Tensor
                   ) -> torch.Tensor:
    num_decodes, max_len = slots.shape
    group_size = attn.num_heads // attn.num_kv_heads
    kv_shape = (num_decodes, max_len, attn.num_kv_heads, attn.head_dim)
    # Gather, then head-major [seqs, kv_heads, context, head_dim] so each matmul operand is contiguous.
    keys, values = kv_cache.gather(slots.reshape(-1), q_dec.dtype)
    keys = keys.view(kv_shape).transpose(1, 2).contiguous()
    values = values.view(kv_shape).transpose(1, 2).contiguous()
    queries = q_dec.reshape(num_decodes, attn.num_kv_heads, group_size, attn.head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float().mul_(attn.scale)  # [seqs, kv_heads, group, ctx]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q_dec.dtype)
    return torch.matmul(probs, values).reshape(num_decodes, attn.num_heads * attn.head_dim)
