"""Runs a step's forward from its `StepInputs` (step_plan.py, made by rank 0): builds what attention needs from them
(tensors of tokens, positions and slots; block tables, the portable path's gather indices, the prefill kernel's
query starts and past lengths) once per step, shared by every layer. Every tensor-parallel rank runs one, on its
own shard and KV pool. The runner also decides, once, which CPU kernels the model runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.engine.cuda_graphs import Capture, CudaGraphCapture, DecodeBuffers, DecodeGraphs, capture_sizes
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.engine.shared_prefix import find_shared_prefixes
from kvserve.engine.step_plan import PromptSpan, StepInputs, StepPlan
from kvserve.model.attention import AttentionMetadata
from kvserve.model.attention_backend import attention_kernels
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.paged_attention import DecodeGroup, PagedAttentionMetadata, PrefillGroup, PrefillSegment

logger = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class StepLogits:
    sampling: list[ScheduledRequest]
    logits: torch.Tensor  # [len(sampling), vocab]
    prompt_spans: list[PromptSpan]
    prompt_logits: torch.Tensor  # [sum of the spans' positions, vocab], in span order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[LayerKVCache], block_size: int,
                 device: torch.device, max_gather_tokens: int | None = None, cascade_attention: bool = True,
                 group_windows: tuple[int | None, ...] | None = None, attention_backend: str = "auto") -> None:
        """`group_windows`: each KV cache group's sliding window (planner/kv_groups.py; default: one group with the
        model's window). `attention_backend`: --attention-backend (model/attention_backend.py)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_gather_tokens = max_gather_tokens  # the portable decode path's bound (see DecodeGroup)
        self.group_windows = group_windows or (model.config.sliding_window,)
        # The backend's kernels for this model and cache format; a part without one runs the portable torch path.
        self.attention = attention_kernels(attention_backend, device, model.dtype, model.config.head_dim, kv_caches[0])
        self.decode_kernel = self.attention.decode
        # Shared prefixes read once per group of sequences (cascade attention): the decode kernels', in the KV
        # cache groups without a window.
        self.cascade_attention = cascade_attention and self.decode_kernel is not None
        self.prefill_kernel = self.attention.prefill
        for layer_cache in kv_caches:  # new K/V: one call per layer (quantizing: instead of ~25 torch ops)
            layer_cache.writer = self.attention.writer(layer_cache)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs

    def graphs_unavailable(self) -> str | None:
        """Why decode steps cannot be captured as CUDA graphs here, or None when they can."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if not self.attention.graph_safe:
            return f"the {self.attention.name} attention backend launches from the host"
        if any(layer.writer is None for layer in self.kv_caches):
            return "this KV format is written by torch ops (int4's per-block keys)"
        return None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: Capture | None = None) -> int:
        """Captures a decode forward per batch-size bucket (cuda_graphs.py), after the KV pool's key offsets and
        scales are final (a graph reads the tensors it was captured with); returns how many. `capture`: CUDA's
        (default) or, in tests, cuda_graphs.eager_capture."""
        sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        buffers = DecodeBuffers.allocate(sizes[-1], len(self.group_windows), max_blocks, self.device)
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(buffers, sizes, self._graph_forward, capture or CudaGraphCapture())
        return len(sizes)

    def _graph_forward(self, buffers: DecodeBuffers, size: int):
        """The forward of a step of `size` decodes over the buffers' first rows, as a graph captures it."""
        paged = tuple(PagedAttentionMetadata(
            slot_mapping=buffers.slots[group, :size],
            decode=DecodeGroup(block_tables=buffers.block_tables[group, :size],
                               context_lens=buffers.context_lens[group, :size],
                               max_context_len=buffers.max_blocks * self.block_size, block_size=self.block_size,
                               kernel=self.decode_kernel))
            for group in range(len(self.group_windows)))
        metadata = AttentionMetadata(query_start_loc=list(range(size + 1)), num_computed_tokens=[0] * size,
                                     paged=paged[0] if len(paged) == 1 else paged)

        def forward() -> torch.Tensor:
            return self.model(buffers.token_ids[:size], buffers.positions[:size], metadata, kv_caches=self.kv_caches,
                              logits_indices=buffers.logits_rows[:size])

        return forward

    @staticmethod
    def logits_of(plan: StepPlan, logits: torch.Tensor) -> StepLogits:
        num_sampling = len(plan.sampling)
        return StepLogits(plan.sampling, logits[:num_sampling], plan.prompt_spans, logits[num_sampling:])

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of `inputs.logits_rows` ([rows, vocab]); None on tensor-parallel ranks other than 0."""
        if self.decode_graphs is not None and not self._shares_prefixes(inputs):
            logits = self.decode_graphs.replay(inputs)
            if logits is not None:
                return logits
        return self.model(
            torch.tensor(inputs.token_ids, device=self.device),
            torch.tensor(inputs.positions, device=self.device),
            self._metadata(inputs),
            kv_caches=self.kv_caches,
            logits_indices=torch.tensor(inputs.logits_rows, device=self.device, dtype=torch.long),
        )

    def _shares_prefixes(self, inputs: StepInputs) -> bool:
        """Whether decodes share prefix blocks that cascade attention reads once (an eager step's gain, which a
        captured graph, reading each context on its own, would lose)."""
        if not self.cascade_attention or inputs.num_decodes < 2:
            return False
        return any(find_shared_prefixes(tables[:inputs.num_decodes], self.block_size) is not None
                   for tables, window in zip(inputs.block_tables, self.group_windows) if window is None)

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The attention metadata: one PagedAttentionMetadata per KV cache group (a tuple when there are several;
        each layer reads its group's, paged_attention.py)."""
        paged = tuple(self._group_metadata(inputs, group) for group in range(len(self.group_windows)))
        return AttentionMetadata(query_start_loc=inputs.query_starts, num_computed_tokens=inputs.num_computed,
                                 paged=paged[0] if len(paged) == 1 else paged)

    def _group_metadata(self, inputs: StepInputs, group: int) -> PagedAttentionMetadata:
        num_seqs, num_decodes = len(inputs.num_computed), inputs.num_decodes
        slots = torch.tensor(inputs.slots[group], dtype=torch.long, device=self.device)
        paged = PagedAttentionMetadata(slot_mapping=slots)
        tables = inputs.block_tables[group]
        if num_decodes:
            paged.decode = self._decode_group(inputs, tables, range(num_decodes), self.group_windows[group])
        if num_decodes < num_seqs:
            paged.prefill = self._prefill_group(inputs, tables, range(num_decodes, num_seqs))
        return paged

    def _decode_group(self, inputs: StepInputs, tables: list[list[int]], seqs: range, window: int | None
                      ) -> DecodeGroup:
        context_lens = [inputs.num_computed[s] + 1 for s in seqs]
        shared = None
        if self.cascade_attention and window is None and len(seqs) > 1:
            found = find_shared_prefixes([tables[s] for s in seqs], self.block_size)
            if found is not None:
                shared = (torch.tensor(found.lens, dtype=torch.long), torch.tensor(found.leaders, dtype=torch.long))
        return DecodeGroup(
            block_tables=self._block_tables(tables, seqs),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=self.device),
            max_context_len=max(context_lens),
            block_size=self.block_size,
            kernel=self.decode_kernel,
            max_gather_tokens=self.max_gather_tokens,
            shared_prefixes=shared,
        )

    def _block_tables(self, tables: list[list[int]], seqs: range) -> torch.Tensor:
        tables = [tables[s] for s in seqs]
        max_blocks = max(len(table) for table in tables)
        return torch.tensor([table + [0] * (max_blocks - len(table)) for table in tables], dtype=torch.long,
                            device=self.device)

    def _prefill_group(self, inputs: StepInputs, tables: list[list[int]], seqs: range) -> PrefillGroup:
        if self.prefill_kernel is None:
            return PrefillGroup([self._prefill_segment(inputs, tables, s) for s in seqs], kernel_inputs=None)
        kernel_inputs = (
            self._block_tables(tables, seqs),
            torch.tensor(inputs.query_starts[seqs.start:], dtype=torch.long),
            torch.tensor([inputs.num_computed[s] for s in seqs], dtype=torch.long),
        )
        return PrefillGroup(segments=[], kernel_inputs=kernel_inputs, kernel=self.prefill_kernel)

    def _prefill_segment(self, inputs: StepInputs, tables: list[list[int]], seq: int) -> PrefillSegment:
        num_past = inputs.num_computed[seq]
        context_slots = None
        if num_past:
            # Whole blocks expanded to slots in one vectorised op: a prefix hit can cover thousands of tokens.
            blocks = torch.tensor(tables[seq], dtype=torch.long, device=self.device)
            offsets = torch.arange(self.block_size, dtype=torch.long, device=self.device)
            context_slots = (blocks.unsqueeze(1) * self.block_size + offsets).flatten()[:inputs.context_len(seq)]
        return PrefillSegment(inputs.query_starts[seq], inputs.query_starts[seq + 1], num_past, context_slots)
