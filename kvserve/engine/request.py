"""A request as the engine tracks it: tokens, progress through the KV cache, sampling state, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the top-k (token id, logprob), most likely first


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    max_model_len: int
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # append-only; outputs hold snapshots of it
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission; -1: not admitted yet
    # Of those and of later re-admissions, tokens the KV tiers loaded into the pool, per tier ("host", "disk").
    tier_loaded_tokens: dict[str, int] = field(default_factory=dict)
    session_id: str | None = None  # the session it belongs to, for the idle-session policy
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # output tokens already handed out in a RequestOutput
    block_hashes: list = field(default_factory=list)  # owned by the request, filled by the KV cache manager
    generator: torch.Generator | None = None  # a seeded request's own, made by the sampler on its first draw
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With prompt_logprobs: entry i scores prompt token i given the ones before it; the first has none (None).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.scores_prompt:
            self.prompt_logprobs = [None]

    @property
    def scores_prompt(self) -> bool:
        """Asked for prompt logprobs: every prompt position's logits are needed."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def append_sampled(self, token_id: int, logprobs) -> None:
        """A sampled token and, when asked for, its logprobs."""
        self.append_output_token(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob

    @property
    def max_output_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
