"""Attention over a flat batch of tokens from several sequences.

The model's layers call `Attention.forward(q, k, v, kv_cache, metadata)` and never look inside the metadata,
so the same layers run a cache-less forward (tests, reference checks) and the engine's paged-cache forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.paged_attention import paged_attention


@dataclass(slots=True)
class AttentionMetadata:
    """Describes how the flat token batch splits into sequences.

    Token i of the batch belongs to sequence s where query_start_loc[s] <= i < query_start_loc[s + 1]; that
    sequence has `num_computed_tokens[s]` tokens of K/V already in the cache before this step.
    """

    query_start_loc: list[int]  # [num_seqs + 1]
    num_computed_tokens: list[int]  # [num_seqs]
    # Set by the engine when a paged KV cache is used; None for a cache-less forward.
    paged: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.num_computed_tokens)

    @classmethod
    def for_prompts(cls, prompt_lens: list[int]) -> "AttentionMetadata":
        starts = [0]
        for length in prompt_lens:
            starts.append(starts[-1] + length)
        return cls(query_start_loc=starts, num_computed_tokens=[0] * len(prompt_lens))


class Attention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 scale: float | None = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: object | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        if metadata.paged is not None:
            return paged_attention(self, q, k, v, kv_cache, metadata)
        return self._cacheless(q, k, v, metadata)

    def _cacheless(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        assert all(n == 0 for n in metadata.num_computed_tokens), "a cache-less forward cannot continue a sequence"
        outputs = []
        starts = metadata.query_start_loc
        for s in range(metadata.num_seqs):
            seq = slice(starts[s], starts[s + 1])
            outputs.append(self.attend(q[seq], k[seq], v[seq], num_past_tokens=0))
        return torch.cat(outputs, dim=0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past_tokens: int) -> torch.Tensor:
        """Causal attention of one sequence's new queries [Q, H, D] over its keys [K, KvH, D].

        The keys are the sequence's whole context: `num_past_tokens` cached ones followed by the Q new ones.
        """
        num_queries, num_keys = q.shape[0], k.shape[0]
        group_size = self.num_heads // self.num_kv_heads
        if group_size > 1:
            # torch's CPU flash kernel takes neither GQA nor 3-d inputs (both fall back to the slow math path),
            # so KV heads are repeated and a batch dim of 1 added; the copy is small next to attention itself.
            k = k.repeat_interleave(group_size, dim=1)
            v = v.repeat_interleave(group_size, dim=1)
        qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        mask = self._mask(num_queries, num_keys, num_past_tokens, q.device)
        if mask is None and num_queries == num_keys:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1).reshape(num_queries, self.num_heads * self.head_dim)

    def _mask(self, num_queries: int, num_keys: int, num_past_tokens: int, device: torch.device) -> torch.Tensor | None:
        needs_window = self.sliding_window is not None and num_keys > self.sliding_window
        if num_queries == 1 and not needs_window:
            return None  # a single new token sees its whole context
        if num_queries == num_keys and not needs_window:
            return None  # plain causal
        query_pos = torch.arange(num_queries, device=device).unsqueeze(1) + num_past_tokens
        key_pos = torch.arange(num_keys, device=device).unsqueeze(0)
        mask = key_pos <= query_pos
        if needs_window:
            mask &= key_pos > query_pos - self.sliding_window
        return mask
