"""What rank 0 makes of a scheduled batch before the forward: `StepInputs`, plain lists of ints every
tensor-parallel rank builds its tensors from (cheap to pickle), plus which rows are sampled and which prompt
positions are scored. Decoding requests go first in the batch so their rows are contiguous, then the prefills.
No torch here: this is the scheduler's side of a step (the runner, model_runner.py, is the model's)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest


@dataclass(slots=True)
class StepInputs:
    """One forward, as every rank needs it: cheap to pickle and send to the tensor-parallel workers."""

    token_ids: list[int]
    positions: list[int]
    slots: list[list[int]]  # per KV cache group: where each new token's K/V goes
    logits_rows: list[int]  # rows whose logits are returned: the sampling rows, then the scored prompt rows
    query_starts: list[int]  # [num_seqs + 1]: sequence s owns rows [query_starts[s], query_starts[s + 1])
    num_computed: list[int]  # [num_seqs]: tokens already in the cache per sequence
    num_decodes: int  # the first num_decodes sequences decode one token each
    # Per KV cache group, [num_seqs]: each sequence's blocks, as many as its context after the step (a window
    # group's leading ones out of its window read RELEASED_BLOCK)
    block_tables: list[list[list[int]]]

    def context_len(self, seq: int) -> int:
        return self.num_computed[seq] + self.query_starts[seq + 1] - self.query_starts[seq]


@dataclass(slots=True)
class PromptSpan:
    """Prompt positions [first_position, first_position + num_positions) of a request scored this step: the
    logits at position p give the logprob of prompt token p + 1."""

    request: Request
    first_position: int
    num_positions: int


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
    num_groups = kv_cache.num_groups
    inputs = StepInputs([], [], [[] for _ in range(num_groups)], [], [0], [],
                        sum(1 for item in ordered if item.num_new_tokens == 1), [[] for _ in range(num_groups)])
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
        for group, table in enumerate(kv_cache.get_block_tables(request.request_id)):
            table = table[: -(-end // size)]
            inputs.slots[group].extend(table[p // size] * size + p % size for p in range(start, end))
            inputs.block_tables[group].append(table)
        inputs.token_ids.extend(request.all_token_ids[start:end])
        inputs.positions.extend(range(start, end))
        inputs.query_starts.append(len(inputs.token_ids))
        inputs.num_computed.append(start)
        if item.completes_prompt:
            inputs.logits_rows.append(len(inputs.token_ids) - 1)
            sampling.append(item)
    inputs.logits_rows.extend(prompt_rows)
    return StepPlan(inputs, sampling, prompt_spans)
