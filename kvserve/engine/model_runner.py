"""Turns a scheduled batch into tensors (tokens, positions, slot mapping, attention metadata), runs the model.

Decoding requests go first in the batch so their rows are contiguous, then the prefills. Two halves: `plan_step`
(rank 0, which owns the scheduler and the block tables) reduces the batch to `StepInputs`, plain lists of
ints; `ModelRunner.run` (every tensor-parallel rank, on its own shard and KV pool) builds what attention needs
from them (block tables, the portable path's gather indices, the prefill kernel's query starts and past
lengths) once per step, shared by every layer, and runs the forward. The runner also decides, once, which CPU
kernels the model runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.kv_storage import LayerKVCache
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.attention import AttentionMetadata
from kvserve.model.cpu_kernels import cpu_kernels, decode_kernel, prefill_kernel, kv_writer
from kvserve.model.layers import BlockQuantWeight
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.paged_attention import DecodeGroup, PagedAttentionMetadata, PrefillGroup, PrefillSegment

logger = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class StepInputs:
    """One forward, as every rank needs it: cheap to pickle and send to the tensor-parallel workers."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each new token's K/V goes
    logits_rows: list[int]  # rows whose logits are returned: the sampling rows, then the scored prompt rows
    query_starts: list[int]  # [num_seqs + 1]: sequence s owns rows [query_starts[s], query_starts[s + 1])
    num_computed: list[int]  # [num_seqs]: tokens already in the cache per sequence
    num_decodes: int  # the first num_decodes sequences decode one token each
    block_tables: list[list[int]]  # [num_seqs]: each sequence's blocks, as many as its context after the step

    def context_len(self, seq: int) -> int:
        return self.num_computed[seq] + self.query_starts[seq + 1] - self.query_starts[seq]


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


@dataclass(slots=True)
class StepPlan:
    inputs: StepInputs
    sampling: list[ScheduledRequest]
    prompt_spans: list[PromptSpan]


def plan_step(scheduled: list[ScheduledRequest], kv_cache: KVCacheManager) -> StepPlan:
    ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first, stable otherwise
    size = kv_cache.block_size
    inputs = StepInputs([], [], [], [], [0], [], sum(1 for item in ordered if item.num_new_tokens == 1), [])
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
            first_row = len(inputs.token_ids) + span.first_position - start
            prompt_rows.extend(range(first_row, first_row + span.num_positions))
        table = kv_cache.get_block_table(request.request_id)[: -(-end // size)]
        inputs.token_ids.extend(request.all_token_ids[start:end])
        inputs.positions.extend(range(start, end))
        inputs.slots.extend(table[p // size] * size + p % size for p in range(start, end))
        inputs.query_starts.append(len(inputs.token_ids))
        inputs.num_computed.append(start)
        inputs.block_tables.append(table)
        if item.completes_prompt:
            inputs.logits_rows.append(len(inputs.token_ids) - 1)
            sampling.append(item)
    inputs.logits_rows.extend(prompt_rows)
    return StepPlan(inputs, sampling, prompt_spans)


def describe_cpu_weights(model: LlamaForCausalLM, plain_bytes: int) -> str:
    kept = model.layers[0].self_attn.qkv_proj.plain
    if isinstance(kept, BlockQuantWeight):
        how = f"the GGUF file's {kept.bits}-bit blocks kept for batches of 1-2 rows (block_quant_linear)"
    elif kept is not None:
        how = "plain copies kept for batches of 1-2 rows (small_batch_linear)"
    else:
        how = "no plain copies for small batches (over layers.SMALL_BATCH_COPY_LIMIT_BYTES, or no CPU kernels)"
    return (f"CPU matmul weights packed for oneDNN, {how}: {model.weight_bytes() / 2**20:.1f} MiB of weights held "
            f"({plain_bytes / 2**20:.1f} MiB as loaded)")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[LayerKVCache], block_size: int,
                 device: torch.device, max_gather_tokens: int | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_gather_tokens = max_gather_tokens  # the portable decode path's bound (see DecodeGroup)
        self.sliding_window = model.config.sliding_window
        # bf16 on CPU: weights packed once for oneDNN, so no matmul reorders them again (same results, faster).
        if device.type == "cpu":
            plain_bytes = model.weight_bytes()
            if model.pack_weights_for_cpu():
                logger.info("%s", describe_cpu_weights(model, plain_bytes))
        kernels = cpu_kernels() if device.type == "cpu" else None
        # The CPU kernels for this model and cache format; None: the portable torch path.
        self.decode_kernel = decode_kernel(kernels, model.dtype, kv_caches[0])
        self.prefill_kernel = prefill_kernel(kernels, model.dtype, model.config.head_dim, kv_caches[0])
        for layer_cache in kv_caches:  # new K/V: one call per layer (quantizing: instead of ~25 torch ops)
            layer_cache.writer = kv_writer(kernels, layer_cache)

    @staticmethod
    def logits_of(plan: StepPlan, logits: torch.Tensor) -> StepLogits:
        num_sampling = len(plan.sampling)
        return StepLogits(plan.sampling, logits[:num_sampling], plan.prompt_spans, logits[num_sampling:])

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of `inputs.logits_rows` ([rows, vocab]); None on tensor-parallel ranks other than 0."""
        return self.model(
            torch.tensor(inputs.token_ids, device=self.device),
            torch.tensor(inputs.positions, device=self.device),
            self._metadata(inputs),
            kv_caches=self.kv_caches,
            logits_indices=torch.tensor(inputs.logits_rows, device=self.device, dtype=torch.long),
        )

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        num_seqs, num_decodes = len(inputs.num_computed), inputs.num_decodes
        paged = PagedAttentionMetadata(slot_mapping=torch.tensor(inputs.slots, dtype=torch.long, device=self.device))
        if num_decodes:
            paged.decode = self._decode_group(inputs, range(num_decodes))
        if num_decodes < num_seqs:
            paged.prefill = self._prefill_group(inputs, range(num_decodes, num_seqs))
        return AttentionMetadata(query_start_loc=inputs.query_starts, num_computed_tokens=inputs.num_computed,
                                 paged=paged)

    def _decode_group(self, inputs: StepInputs, seqs: range) -> DecodeGroup:
        context_lens = [inputs.num_computed[s] + 1 for s in seqs]
        return DecodeGroup(
            block_tables=self._block_tables(inputs, seqs),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            max_context_len=max(context_lens),
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            kernel=self.decode_kernel,
            max_gather_tokens=self.max_gather_tokens,
        )

    def _block_tables(self, inputs: StepInputs, seqs: range) -> torch.Tensor:
        tables = [inputs.block_tables[s] for s in seqs]
        max_blocks = max(len(table) for table in tables)
        return torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables], dtype=torch.long,
                            device=self.device)

    def _prefill_group(self, inputs: StepInputs, seqs: range) -> PrefillGroup:
        if self.prefill_kernel is None:
            return PrefillGroup([self._prefill_segment(inputs, s) for s in seqs], kernel_inputs=None)
        kernel_inputs = (
            self._block_tables(inputs, seqs),
            torch.tensor(inputs.query_starts[seqs.start:], dtype=torch.long),
            torch.tensor([inputs.num_computed[s] for s in seqs], dtype=torch.long),
        )
        return PrefillGroup(segments=[], kernel_inputs=kernel_inputs, kernel=self.prefill_kernel)

    def _prefill_segment(self, inputs: StepInputs, seq: int) -> PrefillSegment:
        num_past = inputs.num_computed[seq]
        context_slots = None
        if num_past:
            # Whole blocks expanded to slots in one vectorised op: a prefix hit can cover thousands of tokens.
            blocks = torch.tensor(inputs.block_tables[seq], dtype=torch.long, device=self.device)
            offsets = torch.arange(self.block_size, dtype=torch.long, device=self.device)
            context_slots = (blocks.unsqueeze(1) * self.block_size + offsets).flatten()[:inputs.context_len(seq)]
        return PrefillSegment(inputs.query_starts[seq], inputs.query_starts[seq + 1], num_past, context_slots)
