"""Per-key requests/min and tokens/min in fixed one-minute windows, counted in the store (so every replica
counts the same requests). A request is refused when the window's request count would pass the limit, or when
the window's tokens already reached it (tokens are only known once the backend answers, so they are added
after; a request may take the window past its token limit, the next one waits)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvserve.gateway.keys import KeyRecord
from kvserve.gateway.request_state import RequestState, StateQuery
from kvserve.gateway.store import Store

WINDOW_S = 60


@dataclass(slots=True)
class LimitState:
    requests_limit: int
    requests_used: int
    tokens_limit: int
    tokens_used: int
    reset_s: float

    @property
    def exceeded(self) -> str | None:
        if self.requests_limit and self.requests_used > self.requests_limit:
            return "requests"
        if self.tokens_limit and self.tokens_used >= self.tokens_limit:
            return "tokens"
        return None

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, for the limits the key has."""
        headers: dict[str, str] = {}
        reset = f"{math.ceil(self.reset_s)}s"
        if self.requests_limit:
            headers["x-ratelimit-limit-requests"] = str(self.requests_limit)
            headers["x-ratelimit-remaining-requests"] = str(max(0, self.requests_limit - self.requests_used))
            headers["x-ratelimit-reset-requests"] = reset
        if self.tokens_limit:
            headers["x-ratelimit-limit-tokens"] = str(self.tokens_limit)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, self.tokens_limit - self.tokens_used))
            headers["x-ratelimit-reset-tokens"] = reset
        return headers


def _window(now: float) -> tuple[int, float]:
    window = int(now // WINDOW_S)
    return window, (window + 1) * WINDOW_S - now


def ask_limits(query: StateQuery, key: KeyRecord, now: float | None = None) -> float:
    """Adds the key's window counters to `query` (this request counted); returns the seconds the window has left."""
    window, reset_s = _window(time.time() if now is None else now)
    if key.requests_per_minute:
        query.requests_counter = f"{key.key_id}:requests:{window}"
        query.counter_ttl_s = WINDOW_S + 5
    if key.tokens_per_minute:
        query.tokens_counter = f"{key.key_id}:tokens:{window}"
    return reset_s


def limit_state(key: KeyRecord, state: RequestState, reset_s: float) -> LimitState:
    return LimitState(key.requests_per_minute, state.requests_used, key.tokens_per_minute, state.tokens_used, reset_s)


async def admit(store: Store, key: KeyRecord, now: float | None = None) -> LimitState:
    """Counts this request in its window and says where the key stands (alone; a completion asks it together
    with the rest of its state)."""
    query = StateQuery()
    reset_s = ask_limits(query, key, now)
    return limit_state(key, await store.read_request_state(query), reset_s)


async def add_tokens(store: Store, key: KeyRecord, num_tokens: int, now: float | None = None) -> None:
    if key.tokens_per_minute and num_tokens > 0:
        window, _ = _window(time.time() if now is None else now)
        await store.counter_add(f"{key.key_id}:tokens:{window}", num_tokens, WINDOW_S + 5)
