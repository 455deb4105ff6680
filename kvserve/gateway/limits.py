"""Per-key requests/min and tokens/min in fixed one-minute windows, counted in the store (so every replica
counts the same requests). A request is refused when the window's request count would pass the limit, or when
the tokens it may cost (token_budget: its prompt and max_tokens) would take the window's tokens past theirs:
those are reserved as it is admitted, in the same atomic store call, so a burst sent at once cannot all get in.
Once the answer shows what it used the reservation is settled to that; a stream the client left is charged
what was sent."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvserve.gateway.keys import KeyRecord
from kvserve.gateway.request_state import RequestState, StateQuery
from kvserve.gateway.store import Store
from kvserve.gateway.token_budget import TokenCost, TokenReservation

WINDOW_S = 60


@dataclass(slots=True)
class LimitState:
    requests_limit: int
    requests_used: int
    tokens_limit: int
    tokens_used: int
    reset_s: float
    tokens_refused: bool = False  # this request's tokens would pass the limit

    @property
    def exceeded(self) -> str | None:
        if self.requests_limit and self.requests_used > self.requests_limit:
            return "requests"
        if self.tokens_limit and self.tokens_refused:
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


def ask_limits(query: StateQuery, key: KeyRecord, cost: TokenCost, now: float | None = None) -> float:
    """Adds the key's window counters to `query` (this request counted, its tokens reserved); returns the seconds
    the window has left."""
    window, reset_s = _window(time.time() if now is None else now)
    query.counter_ttl_s = WINDOW_S + 5
    if key.requests_per_minute:
        query.requests_counter = f"{key.key_id}:requests:{window}"
    if key.tokens_per_minute:
        query.tokens_counter = f"{key.key_id}:tokens:{window}"
        query.tokens_limit = key.tokens_per_minute
        query.tokens_cost = cost
    return reset_s


def limit_state(key: KeyRecord, state: RequestState, reset_s: float) -> LimitState:
    refused = bool(key.tokens_per_minute) and state.tokens_reserved == 0
    return LimitState(key.requests_per_minute, state.requests_used, key.tokens_per_minute, state.tokens_used,
                      reset_s, refused)


def reservation_of(query: StateQuery, state: RequestState) -> TokenReservation | None:
    if query.tokens_counter is None or not state.tokens_reserved:
        return None
    cost = query.tokens_cost
    return TokenReservation(query.tokens_counter, state.tokens_reserved, cost.prompt_tokens,
                            open_ended=cost.completion_tokens is None)


async def admit(store: Store, key: KeyRecord, cost: TokenCost, now: float | None = None) -> LimitState:
    """Counts this request in its window and says where the key stands (alone; a completion asks it together
    with the rest of its state)."""
    query = StateQuery()
    reset_s = ask_limits(query, key, cost, now)
    return limit_state(key, await store.read_request_state(query), reset_s)


async def settle(store: Store, reservation: TokenReservation, used_tokens: int) -> None:
    """The window is charged `used_tokens` for a request that reserved `reservation.reserved` (in the window it
    was admitted in, whenever it ends)."""
    if used_tokens != reservation.reserved:
        await store.counter_add(reservation.counter, used_tokens - reservation.reserved, WINDOW_S + 5)
        reservation.reserved = used_tokens


async def reserve_more(store: Store, reservation: TokenReservation, extra_tokens: int, tokens_limit: int) -> bool:
    """Adds to a reservation the prompt tokens admission could not know (a conversation's stored history, read in
    the same call). False when the window cannot take them: the caller refunds the reservation and refuses.
    Counted before the check, like admission, so requests racing each other never pass the limit together."""
    if extra_tokens <= 0:
        return True
    reservation.prompt_tokens += extra_tokens
    if reservation.open_ended:  # it holds all the window had left: the whole prompt must fit in that
        return reservation.prompt_tokens < reservation.reserved
    used = await store.counter_add(reservation.counter, extra_tokens, WINDOW_S + 5)
    reservation.reserved += extra_tokens
    return used <= tokens_limit
