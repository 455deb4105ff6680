"""LLMEngine: requests in, one scheduler step + one forward + sampling per `step()`, outputs out.

Parallel sampling (n > 1) runs as n sibling requests with the same prompt; their full prompt blocks are shared
through the prefix cache, and their outputs are gathered under the parent's id.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from dataclasses import dataclass, field

import torch

from kvserve.cache.storage.block_copier import BlockCopier
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.tier_stats import TierStats
from kvserve.config import EngineConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.devices import cpu_threads_per_rank, pick_device, rank_device
from kvserve.engine.idle_sessions import IdleSessions
from kvserve.engine.model_runner import ModelRunner, StepLogits
from kvserve.engine.step_plan import plan_step
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.pool_sizing import PoolPlan
from kvserve.engine.rank_state import RankState, build_rank
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import prompt_logprobs, sample
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import ModelOutput, Scheduler, SchedulerOutput, StepUpdate
from kvserve.engine.tier_setup import build_tiers
from kvserve.engine.tp_group import ShardedBlockCopier, TensorParallelGroup
from kvserve.model.loader import LoadedModel, check_tensor_parallel
from kvserve.model.tensor_parallel import WHOLE_MODEL, TensorShard

logger = logging.getLogger("kvserve.engine")


class RequestRejected(ValueError):
    """The request cannot be served as given (too long, bad parameters); nothing was queued."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(slots=True)
class ParentRequest:
    request_id: str
    prompt: str | None
    children: list[Request]
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot for metrics: gauges now, counters since start (never reset)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use
    num_blocks: int
    prefix_cache_queries: int  # tokens looked up at admission (vLLM semantics)
    prefix_cache_hits: int  # of which found in the cache
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished_by_reason: dict[str, int]
    tiers: dict[str, TierStats] = field(default_factory=dict)  # per KV tier ("host", "disk"), when configured


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    generation_tokens: int = 0
    num_steps: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = pick_device(config.device)
        torch.manual_seed(config.seed)
        tp_size = config.parallel.tensor_parallel_size
        self.tp: TensorParallelGroup | None = None
        try:
            rank = self._build_rank(config, tp_size)
        except BaseException:
            self.close()
            raise
        self.loaded: LoadedModel = rank.loaded
        self.tokenizer = self.loaded.tokenizer
        self.pool: PoolPlan = rank.pool
        self.max_model_len = self.pool.max_model_len
        cache_cfg = config.cache
        self.kv_cache = KVCacheManager(
            self.pool.num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching, cache_cfg.prefix_caching_hash_algo,
            self.pool.layout.windows,
        )
        if rank.fp8_scales:
            logger.info("fp8 KV scales: %s", rank.fp8_scales)
        if rank.calibration_tokens:
            logger.info("%s KV: key offsets measured on %d tokens of the built-in calibration text",
                        self.pool.kv_format, rank.calibration_tokens)
        copier = None if self.tp is None else ShardedBlockCopier(BlockCopier(rank.storage), self.tp)
        self.tiers = build_tiers(cache_cfg, self.loaded, rank.storage, self.pool.kv_format, copier)
        if self.tiers is not None:
            self.kv_cache.attach_tiers(self.tiers)
        idle_seconds = cache_cfg.kv_idle_offload_seconds
        self.idle_sessions = IdleSessions(idle_seconds) if idle_seconds is not None else None
        self.runner = rank.runner
        logger.info("attention: the %s backend's kernels; %s", self.runner.attention.name, rank.cuda_graphs)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.parents: dict[str, ParentRequest] = {}
        self.child_parent: dict[str, str] = {}
        self.counters = EngineCounters()

    def _build_rank(self, config: EngineConfig, tp_size: int) -> RankState:
        """This process's shard (all of the model at TP 1); under TP, the workers build theirs alongside."""
        if tp_size == 1:
            rank = build_rank(config, self.device, WHOLE_MODEL)
            logger.info(rank.describe_pool())
            return rank
        check_tensor_parallel(config.model, tp_size)
        self.device = rank_device(config, 0)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(tp_size))
        self.tp = TensorParallelGroup(config, tp_size, self.device)
        try:
            ranks = self.tp.ranks
            rank = build_rank(config, self.device, TensorShard(0, tp_size, ranks), ranks.agree_num_blocks)
        except RuntimeError as exc:  # a collective failed: most likely a worker died while loading
            raise self.tp.failed(exc) from None
        for line in [rank.describe_pool(), *self.tp.wait_ready()]:
            logger.info(line)
        return rank

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model=model, **engine_args))

    # ---- requests in ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> None:
        """`session_id` (OpenAI's `user`, or X-Session-ID) lets --kv-idle-offload-seconds find the session's blocks."""
        params = params or SamplingParams()
        if request_id in self.parents:
            raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids, params)
        token_ids = [int(t) for t in token_ids]  # numpy's integers are welcome; downstream sees plain ints
        children = [self._make_child(request_id, index, token_ids, params, cache_salt) for index in range(params.n)]
        self.parents[request_id] = ParentRequest(request_id, prompt_text, children)
        for child in children:
            child.session_id = session_id
            self.child_parent[child.request_id] = request_id
            self.scheduler.add(child)

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestRejected("the prompt is empty; send at least one token", param="prompt")
        vocab = self.loaded.config.vocab_size
        wrong_type = next((t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if wrong_type is not None:
            raise RequestRejected(f"token ids must be integers; got {wrong_type!r}", param="prompt")
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is out of vocabulary (0..{vocab - 1})", param="prompt")
        bad = next((t for t in params.logit_bias or {} if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"logit_bias token id {bad} is out of vocabulary (0..{vocab - 1})",
                                  param="logit_bias")
        if len(token_ids) > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens", code="context_length_exceeded", param="prompt",
            )

    def _make_child(self, parent_id: str, index: int, token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None) -> Request:
        child_params = params
        if params.n > 1 and params.seed is not None:
            # Each sibling draws differently, yet reproducibly.
            child_params = dataclasses.replace(params, seed=params.seed + index)
        if index > 0 and params.prompt_logprobs is not None:
            child_params = dataclasses.replace(child_params, prompt_logprobs=None)  # siblings share the prompt
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, stop=list(params.stop), skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        child_id = parent_id if params.n == 1 else f"{parent_id}#{index}"
        return Request(
            child_id, token_ids, child_params, self.loaded.eos_token_ids, detokenizer, self.max_model_len,
            cache_salt=cache_salt,
        )

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self.child_parent.pop(child.request_id, None)
                if not child.status.finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    # ---- the step ---------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def stats(self) -> EngineStats:
        cache_stats = self.kv_cache.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_blocks=self.kv_cache.num_blocks,
            prefix_cache_queries=cache_stats.queries,
            prefix_cache_hits=cache_stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            finished_by_reason=dict(self.counters.finished_by_reason),
            tiers=self.tiers.snapshot() if self.tiers is not None else {},
        )

    def offload_idle_sessions(self, now: float | None = None) -> int:
        """--kv-idle-offload-seconds: moves the blocks of sessions idle that long from the pool to the tiers.
        Returns the blocks moved."""
        if self.idle_sessions is None:
            return 0
        return sum(self.kv_cache.offload_cached(hashes) for hashes in self.idle_sessions.due(now))

    def idle_offload_wait(self) -> float | None:
        """Seconds until the idle-session policy has work (0: now); None when it has none coming."""
        return None if self.idle_sessions is None else self.idle_sessions.seconds_to_next()

    def close(self) -> None:
        """Saves what the KV tiers must keep across a restart (the disk tier) for up to --kv-disk-save-timeout
        seconds, stops their writer, and stops the tensor-parallel workers."""
        tiers, self.tiers = getattr(self, "tiers", None), None
        try:
            if tiers is not None:
                cached = self.kv_cache.pool.cached_blocks
                deadline = time.monotonic() + self.config.cache.kv_disk_save_timeout
                tiers.close([block.block_id for block in cached.values()], list(cached), deadline)
        finally:
            if self.tp is not None:
                self.tp.close()

    def step(self) -> list[RequestOutput]:
        self.offload_idle_sessions()
        scheduler_output = self.scheduler.schedule()
        model_output = self._execute(scheduler_output)
        update = self.scheduler.update_from_output(scheduler_output, model_output, time.monotonic())
        return self._outputs(update)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """The step's block copies (even when nothing runs: an admission that did not fit may have loaded
        blocks), its forward (on every rank), prompt logprobs and sampled tokens."""
        if scheduler_output.transfers:
            self.tiers.apply(scheduler_output.transfers)
        if not scheduler_output.scheduled:
            return ModelOutput()
        started = time.perf_counter()
        step = self._forward(scheduler_output.scheduled)
        self.counters.num_steps += 1
        if self.tiers is not None:  # what a load must beat: this engine's measured prefill speed
            prefill_tokens = sum(item.num_new_tokens for item in scheduler_output.scheduled if item.num_new_tokens > 1)
            self.tiers.note_prefill(prefill_tokens, time.perf_counter() - started)
        requests = [item.request for item in step.sampling]
        return ModelOutput(list(zip(requests, sample(step.logits, requests))), self._prompt_logprobs(step))

    def _forward(self, scheduled) -> StepLogits:
        plan = plan_step(scheduled, self.kv_cache)
        if self.tp is None:
            return ModelRunner.logits_of(plan, self.runner.run(plan.inputs))
        self.tp.send_step(plan.inputs)
        try:
            logits = self.runner.run(plan.inputs)
        except RuntimeError as exc:  # a collective failed: a worker died mid-step
            raise self.tp.failed(exc) from None
        return ModelRunner.logits_of(plan, logits)

    @staticmethod
    def _prompt_logprobs(step: StepLogits) -> list[tuple[Request, list]]:
        scored, row = [], 0
        for span in step.prompt_spans:
            request = span.request
            first = span.first_position
            next_tokens = request.prompt_token_ids[first + 1:first + 1 + span.num_positions]
            logits = step.prompt_logits[row:row + span.num_positions]
            scored.append((request, prompt_logprobs(logits, next_tokens, request.sampling_params.prompt_logprobs)))
            row += span.num_positions
        return scored

    def _outputs(self, update: StepUpdate) -> list[RequestOutput]:
        """The step's outputs, one per parent request that got a token; the counters and idle sessions noted."""
        self.counters.generation_tokens += len(update.sampled)
        self.counters.prompt_tokens += sum(request.num_prompt_tokens for request in update.first_tokens)
        for request in update.finished:
            if request.session_id is not None and self.idle_sessions is not None:
                self.idle_sessions.note(request.session_id, request.block_hashes, request.finished_time)
            reason = request.status.value
            self.counters.finished_by_reason[reason] = self.counters.finished_by_reason.get(reason, 0) + 1
        touched = dict.fromkeys(self.child_parent[request.request_id] for request in update.sampled)
        return [self._output(parent_id) for parent_id in touched]

    # ---- outputs out ------------------------------------------------------------------------------------

    def _output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        outputs = [self._completion(index, child) for index, child in enumerate(parent.children)]
        finished = all(child.status.finished for child in parent.children)
        first = parent.children[0]
        if finished:
            self.parents.pop(parent_id)
            for child in parent.children:
                self.child_parent.pop(child.request_id, None)
        return RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
            tier_loaded_tokens=dict(first.tier_loaded_tokens),
            prompt_logprobs=first.prompt_logprobs if first.scores_prompt else None,
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=max((c.finished_time or 0.0) for c in parent.children) if finished else None,
        )

    def _completion(self, index: int, request: Request) -> CompletionOutput:
        finished = request.status.finished
        detok = request.detokenizer
        delta_text = detok.delta(finished)
        num_tokens = request.num_output_tokens
        sent = request.num_sent_tokens
        request.num_sent_tokens = num_tokens
        wants_logprobs = request.sampling_params.logprobs is not None
        return CompletionOutput(
            index=index,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
            delta_text=delta_text,
            delta_token_ids=request.output_token_ids[sent:num_tokens],
            delta_logprobs=request.logprobs[sent:num_tokens] if wants_logprobs else None,
            _text=detok.text,
            _num_chars=len(detok.text) if finished else detok.num_sent_chars,
            _tokens=request.output_token_ids,
            _num_tokens=num_tokens,
            _logprobs=request.logprobs if wants_logprobs else None,
        )
