"""Iteration-level scheduling: every step spends a token budget on running requests, then admits waiting ones.

A request is a token list with a count of tokens already computed into the KV cache; each step gives it
`min(remaining, budget)` new tokens, which makes chunked prefill, decode and recompute after preemption the
same operation. When the pool has no block for a running request, the newest running request is preempted
(its blocks freed, its progress reset) and put back at the head of the waiting queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.cache.kv_cache_manager import NO_HIT, KVCacheManager
from kvserve.cache.transfers import Transfer
from kvserve.config import SchedulerConfig
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.stopping import stop_status

if TYPE_CHECKING:
    from kvserve.engine.sampler import SampledToken  # the sampler is torch; the scheduler is bookkeeping

# lpm: a waiting request passed over this many times is admitted next whatever its cached prefix.
LPM_MAX_SKIPS = 16


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed, so the step's last logits give the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)  # block copies to do, in order, before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class ModelOutput:
    """What a step's forward and sampling produced, for update_from_output."""

    sampled: list[tuple[Request, SampledToken]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Request, list]] = field(default_factory=list)  # each request's newly scored positions


@dataclass(slots=True)
class StepUpdate:
    """What update_from_output changed, for the engine's outputs and counters."""

    sampled: list[Request] = field(default_factory=list)  # got a token this step
    first_tokens: list[Request] = field(default_factory=list)  # of those, their first
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._lpm_skips: dict[str, int] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(output, budget)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        output.transfers = self.kv_cache.take_transfers()
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            while self.kv_cache.allocate_slots(request, num_new, request.num_computed_tokens) is None:
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    return budget
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            hit = NO_HIT if request.scores_prompt else self.kv_cache.lookup_prefix(request)  # no logits in a hit
            for tier, tokens in hit.loaded.items():
                request.tier_loaded_tokens[tier] = request.tier_loaded_tokens.get(tier, 0) + tokens
            num_hit_tokens = hit.num_tokens
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, num_hit_tokens, hit.block_ids) is None:
                return  # FCFS: nobody overtakes the request that does not fit
            if request is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)  # lpm picked one from further back
            self._lpm_skips.pop(request.request_id, None)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _cached_prefix(self, request: Request) -> tuple[list[int], int]:
        if request.scores_prompt:
            return [], 0  # a cached prefix has no logits to score
        return self.kv_cache.get_computed_blocks(request)

    def _next_waiting(self) -> Request:
        if self.config.scheduling_policy == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        head = self.waiting[0]
        if self._lpm_skips.get(head.request_id, 0) >= LPM_MAX_SKIPS:
            return head  # starvation bound
        best = max(self.waiting, key=lambda r: self._cached_prefix(r)[1])
        if best is not head:
            self._lpm_skips[head.request_id] = self._lpm_skips.get(head.request_id, 0) + 1
        return best

    def update_from_output(self, output: SchedulerOutput, model_output: ModelOutput, now: float) -> StepUpdate:
        """The one place a step's results change requests: each scheduled request advances by the tokens it
        computed, prompt logprobs and sampled tokens are appended, and a request that stops is finished (its
        blocks freed for the next step)."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for request, scored in model_output.prompt_logprobs:
            request.prompt_logprobs += scored
        update = StepUpdate()
        for request, token in model_output.sampled:
            if request.first_token_time is None:
                request.first_token_time = now
                update.first_tokens.append(request)
            request.append_sampled(token.token_id, token.logprobs)
            update.sampled.append(request)
            stop_string = request.detokenizer.append(token.token_id)
            status = stop_status(request, token.token_id, stop_string, self.max_model_len)
            if status is not None:
                self.finish(request, status)
                update.finished.append(request)
        return update

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Frees a finished or aborted request's blocks now, so the next step can use them."""
        request.status = status
        request.finished_time = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._lpm_skips.pop(request.request_id, None)
        self.kv_cache.free(request)
