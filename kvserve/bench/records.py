"""What the load tester knows about one request once it is over, successful or not."""

from __future__ import annotations

from dataclasses import dataclass, field

# Error kinds, as reported: `http_<status>` for an error status, and these.
TIMEOUT = "timeout"  # no complete answer within --timeout
CONNECTION = "connection"  # could not connect, or the connection broke mid-answer
MALFORMED_STREAM = "malformed_stream"  # a response that is not OpenAI's SSE (bad JSON, no [DONE], no choices)
STREAM_ERROR = "stream_error"  # the server sent an error event in the middle of the stream
CLIENT_ERROR = "client_error"  # anything else the client raised: a bug here, reported rather than crashing the run


@dataclass(slots=True)
class RequestRecord:
    session_index: int
    turn_index: int
    start_s: float  # when it was sent, seconds since the measured run started
    max_tokens: int
    # Open loop: when the arrival process scheduled this request, on start_s's clock; start_s is later when the
    # client ran late or --max-concurrency held it back. None in a closed loop and for a session's later turns
    # (they follow the previous answer, not the schedule).
    scheduled_s: float | None = None
    ok: bool = False
    error_kind: str | None = None
    error_message: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    # Arrival of each chunk that carried output text, in seconds since the request was sent.
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (llama-server: timings.cache_n)
    finish_reason: str | None = None
    output_text: str = ""

    @property
    def output_tokens(self) -> int:
        """usage's count when the server sent one, else one token per chunk (what SSE streams usually carry)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def inter_token_latencies_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def time_per_output_token_s(self) -> float | None:
        """Decode time per token after the first (vLLM's TPOT); None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> None:
        self.ok = False
        self.error_kind = kind
        self.error_message = message[:500]
