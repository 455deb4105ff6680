"""Turns a scheduled batch into tensors (tokens, positions, slot mapping, attention metadata), runs the model.

Decoding requests go first in the batch so their rows are contiguous, then the prefills. What attention needs
(block tables, the portable path's gather indices, the prefill kernel's query starts and past lengths) is built
once per step here and shared by every layer. It also decides, once, which CPU kernels the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_storage import LayerKVCache
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.attention import AttentionMetadata
from kvserve.model.cpu_kernels import cpu_kernels, decode_kernel, prefill_kernel, quantized_writer
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.paged_attention import DecodeGroup, PagedAttentionMetadata, PrefillGroup, PrefillSegment


@dataclass(slots=True)
class PromptSpan:
    """Prompt positions [first_position, first_position + num_positions) of a request scored this step: the
    logits at position p give the logprob of prompt token p + 1."""

    request: Request
    first_position: int
    num_positions: int


@dataclass(slots=True)
class StepLogits:
    sampling: list[ScheduledRequest]
    logits: torch.Tensor  # [len(sampling), vocab]
    prompt_spans: list[PromptSpan]
    prompt_logits: torch.Tensor  # [sum of the spans' positions, vocab], in span order


def _prompt_span(request: Request, start: int, end: int) -> PromptSpan | None:
    """The positions of this step whose next prompt token is not scored yet (a recompute after preemption
    skips what was scored before)."""
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(end, request.num_prompt_tokens - 1)
    return PromptSpan(request, first, last - first) if first < last else None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[LayerKVCache], kv_cache: KVCacheManager,
                 device: torch.device, max_gather_tokens: int | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.max_gather_tokens = max_gather_tokens  # the portable decode path's bound (see DecodeGroup)
        self.sliding_window = model.config.sliding_window
        # bf16 on CPU: weights packed once for oneDNN, so no matmul reorders them again (same results, faster).
        if device.type == "cpu":
            model.pack_weights_for_cpu()
        kernels = cpu_kernels() if device.type == "cpu" else None
        # The CPU kernels for this model and cache format; None: the portable torch path.
        self.decode_kernel = decode_kernel(kernels, model.dtype, kv_caches[0])
        self.prefill_kernel = prefill_kernel(kernels, model.dtype, model.config.head_dim, kv_caches[0])
        for layer_cache in kv_caches:  # quantizing new K/V: one call per layer instead of ~25 torch ops
            layer_cache.encoder = quantized_writer(kernels, layer_cache)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        """Runs one forward; returns the logits of the requests that sample this step and of the prompt
        positions scored for prompt logprobs."""
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable otherwise
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        prompt_rows: list[int] = []
        prompt_spans: list[PromptSpan] = []
        for item in ordered:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            span = _prompt_span(request, start, end) if request.scores_prompt else None
            if span is not None:
                prompt_spans.append(span)
                first_row = len(token_ids) + span.first_position - start
                prompt_rows.extend(range(first_row, first_row + span.num_positions))
            token_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(request.request_id, start, end))
            if item.completes_prompt:
                logits_rows.append(len(token_ids) - 1)
                sampling.append(item)
        metadata = self._metadata(ordered, slots)
        logits = self.model(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            metadata,
            kv_caches=self.kv_caches,
            logits_indices=torch.tensor(logits_rows + prompt_rows, device=self.device, dtype=torch.long),
        )
        return StepLogits(sampling, logits[: len(sampling)], prompt_spans, logits[len(sampling):])

    def _slots(self, request_id: str, start: int, end: int) -> list[int]:
        table = self.kv_cache.get_block_table(request_id)
        size = self.block_size
        if end - start == 1:
            return [table[start // size] * size + start % size]
        return [table[p // size] * size + p % size for p in range(start, end)]

    def _metadata(self, ordered: list[ScheduledRequest], slots: list[int]) -> AttentionMetadata:
        starts = [0]
        for item in ordered:
            starts.append(starts[-1] + item.num_new_tokens)
        num_decodes = sum(1 for item in ordered if item.num_new_tokens == 1)
        paged = PagedAttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device))
        if num_decodes:
            paged.decode = self._decode_group(ordered[:num_decodes])
        if num_decodes < len(ordered):
            paged.prefill = self._prefill_group(ordered[num_decodes:], starts[num_decodes:])
        return AttentionMetadata(
            query_start_loc=starts,
            num_computed_tokens=[item.request.num_computed_tokens for item in ordered],
            paged=paged,
        )

    def _decode_group(self, decodes: list[ScheduledRequest]) -> DecodeGroup:
        context_lens = [item.request.num_computed_tokens + 1 for item in decodes]
        return DecodeGroup(
            block_tables=self._block_tables(decodes, context_lens),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            max_context_len=max(context_lens),
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            kernel=self.decode_kernel,
            max_gather_tokens=self.max_gather_tokens,
        )

    def _block_tables(self, items: list[ScheduledRequest], context_lens: list[int]) -> torch.Tensor:
        max_blocks = -(-max(context_lens) // self.block_size)
        tables = [self.kv_cache.get_block_table(item.request.request_id)[:max_blocks] for item in items]
        return torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables], dtype=torch.long,
                            device=self.device)

    def _prefill_group(self, prefills: list[ScheduledRequest], starts: list[int]) -> PrefillGroup:
        if self.prefill_kernel is None:
            segments = [self._prefill_segment(item, starts[i], starts[i + 1]) for i, item in enumerate(prefills)]
            return PrefillGroup(segments, kernel_inputs=None)
        num_past = [item.request.num_computed_tokens for item in prefills]
        context_lens = [past + item.num_new_tokens for past, item in zip(num_past, prefills)]
        kernel_inputs = (
            self._block_tables(prefills, context_lens),
            torch.tensor(starts, dtype=torch.long),
            torch.tensor(num_past, dtype=torch.long),
        )
        return PrefillGroup(segments=[], kernel_inputs=kernel_inputs, kernel=self.prefill_kernel)

    def _prefill_segment(self, item: ScheduledRequest, token_start: int, token_end: int) -> PrefillSegment:
        num_past = item.request.num_computed_tokens
        context_slots = None
        if num_past:
            # Whole blocks expanded to slots in one vectorised op: a prefix hit can cover thousands of tokens.
            context_len = num_past + item.num_new_tokens
            table = self.kv_cache.get_block_table(item.request.request_id)[: -(-context_len // self.block_size)]
            blocks = torch.tensor(table, dtype=torch.long, device=self.device)
            offsets = torch.arange(self.block_size, dtype=torch.long, device=self.device)
            context_slots = (blocks.unsqueeze(1) * self.block_size + offsets).flatten()[:context_len]
        return PrefillSegment(token_start, token_end, num_past, context_slots)
