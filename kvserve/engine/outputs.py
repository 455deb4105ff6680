"""What the engine hands back per request: vLLM's RequestOutput / CompletionOutput shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request, as of one engine step.

    The cumulative fields (text, token_ids, logprobs) are snapshots taken lazily: the output keeps a reference to
    the request's append-only lists and their length at this step, so building an output each step costs O(1)
    instead of copying everything generated so far (which made long generations quadratic).
    """

    index: int
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None
    delta_text: str  # new since the previous output of this request (for streaming)
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprobs] | None
    _text: str  # the detokenizer's text at this step (strings are immutable: holding it is a snapshot)
    _num_chars: int  # how much of it this output shows
    _tokens: list[int]
    _num_tokens: int
    _logprobs: list[TokenLogprobs] | None

    @property
    def text(self) -> str:
        return self._text[: self._num_chars]

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[: self._num_tokens]

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return None if self._logprobs is None else self._logprobs[: self._num_tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Of num_cached_tokens and of re-admissions' hits, tokens the KV tiers loaded back, per tier (kvserve extra).
    tier_loaded_tokens: dict[str, int] = field(default_factory=dict)
    # With prompt_logprobs: one entry per prompt token, None for the first (complete once the prefill is done).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
