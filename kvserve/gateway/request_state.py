"""What one completion request must read from the store before it is routed, asked in one round trip: the key's
record (so a revoked key is refused on its next request), its rate-limit window's counters (the request counted),
the session's backend, the conversation's stored messages and, for a request without a session, the prefix
index's entries for its blocks. Asked one by one these were three to five Redis round trips per request, each
~0.2-1 ms on a loaded machine: the better part of the gateway's added latency."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.gateway.prefix import PrefixEntry
from kvserve.gateway.token_budget import TokenCost


@dataclass(slots=True)
class StateQuery:
    key_id: str | None = None  # read this key's record
    requests_counter: str | None = None  # add 1 to this counter and read it
    tokens_counter: str | None = None  # reserve tokens_cost in this counter, unless that passes tokens_limit
    tokens_limit: int = 0
    tokens_cost: TokenCost | None = None
    counter_ttl_s: int = 0
    session_id: str | None = None
    conversation_id: str | None = None  # as stored (owner/id)
    prefix_hashes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    key_record: dict | None = None
    requests_used: int = 0
    tokens_used: int = 0  # the window's tokens, this request's reservation included if it was admitted
    tokens_reserved: int = 0  # 0: refused (its cost would pass the limit)
    session_backend: str | None = None
    conversation: list[dict] = field(default_factory=list)
    prefix_entries: list[PrefixEntry | None] = field(default_factory=list)
