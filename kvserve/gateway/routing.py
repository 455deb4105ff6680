"""Which backend serves a request, and why.

- A request with a session follows the session's backend (reason `session`) while it is up and not queueing
  (its /metrics reports llm-d's 5 waiting requests), and while its queue is not far past the others' (else it
  moves to the shortest queue: `rebalance`).
  A new session is placed by consistent hashing with bounded load (`session_new` on its ring owner,
  `bounded` when the owner is over its share and the session goes further round the ring); a session whose
  backend is down, refused it, or is queueing while another is not, moves (`failover`) and stays moved. High KV
  usage alone never moves a held session: a pool full of its own sessions' caches is doing its job, and a move
  costs the session its whole history (with pools sized to their sessions, llm-d's 80% KV saturation moved
  sessions back and forth and cost 7.6% of all prompt tokens in benchmarks/gateway.py). Saturation (waiting
  or KV usage) still steers new sessions and prefix requests.
- A request without a session goes where the longest run of its prompt's leading blocks was last served
  (`prefix`), else to the least-loaded backend (`load`).
- `round_robin` ignores all of it: the baseline the benchmark compares against.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from kvserve.gateway.backends import Backend
from kvserve.gateway.hashring import HashRing, bounded_owner
from kvserve.gateway.prefix import PrefixEntry, longest_match, prefix_missed
from kvserve.gateway.rebalance import rebalance_target
from kvserve.gateway.recent import RecentWrites
from kvserve.gateway.request_state import RequestState
from kvserve.gateway.store import Store, spawn

SESSION, SESSION_NEW, BOUNDED, PREFIX, LOAD, FAILOVER, REBALANCE, ROUND_ROBIN = (
    "session", "session_new", "bounded", "prefix", "load", "failover", "rebalance", "round_robin")
POLICIES = ("session", "round-robin")


class NoBackendAvailable(Exception):
    pass


@dataclass(slots=True)
class RoutingConfig:
    policy: str = "session"
    # A backend's share of live sessions, as a multiple of the mean (Mirrokni et al.'s c; they use 1.25 to move
    # fewer keys when the set changes). The session map is stored, so placed sessions never move with it and
    # the bound only decides where new ones go: 1.0 keeps backends' session counts within one of each other.
    load_factor: float = 1.0
    saturation_waiting: float = 5.0  # llm-d: saturated at 5 waiting requests ...
    saturation_kv_usage: float = 0.8  # ... or 80% KV usage
    min_prefix_blocks: int = 1
    # A held session moves when its backend's queue is over this multiple of the mean (0: never for load): a
    # lower bound moves sessions back and forth as queues fluctuate (1.5 made twice the moves for the same balance
    # in benchmarks/gateway.py --skewed), each move a cache miss ...
    rebalance_ratio: float = 2.0
    # ... and at least this many requests: below it a cache miss costs more than the wait it saves.
    rebalance_min_queue: int = 4


@dataclass(slots=True)
class RouteDecision:
    backend: Backend
    reason: str
    prefix_depth: int = 0  # a `prefix` decision: the blocks matched ...
    prefix_seen: float = 0.0  # ... and when the deepest was recorded


class Router:
    def __init__(self, backends: list[Backend], store: Store, config: RoutingConfig) -> None:
        self.backends = backends
        self.by_url = {b.url: b for b in backends}
        self.store = store
        self.config = config
        self.ring = HashRing([b.url for b in backends])
        self._round_robin = itertools.cycle(range(len(backends)))
        self.recent_prefixes = RecentWrites()
        self._placement_lock = asyncio.Lock()

    async def route(self, session_id: str | None, block_hashes: list[str], exclude: set[str],
                    known: RequestState | None = None) -> RouteDecision:
        """`known`: the session's backend and the prefix entries as the request's state read found them a moment
        ago (None: read them now, as a retry must, since the first attempt may have placed the session)."""
        candidates = [b for b in self.backends if b.available() and b.url not in exclude]
        if not candidates:
            raise NoBackendAvailable(self._why_none(exclude))
        if self.config.policy == "round-robin":
            return RouteDecision(self._next_round_robin(candidates), ROUND_ROBIN)
        if session_id is not None:
            current_url = known.session_backend if known else await self.store.get_session(session_id)
            return await self._route_session(session_id, current_url, candidates)
        entries = known.prefix_entries if known else await self.store.prefix_lookup(block_hashes)
        return self._route_prefix_or_load(entries, candidates)

    def wants_prefix_lookup(self, session_id: str | None) -> bool:
        return self.config.policy != "round-robin" and session_id is None

    def record(self, decision: RouteDecision, block_hashes: list[str]) -> None:
        """The prefix index learns from every decision: the blocks are now in that backend's cache. Written in
        the background: the request need not wait for it (a request racing it routes by load instead)."""
        # The last hash names the whole chain: the same chain to the same backend a moment ago is the same write.
        if block_hashes and self.recent_prefixes.due(block_hashes[-1], decision.backend.url):
            spawn(self.store.prefix_record(block_hashes, decision.backend.url))

    def observe_cache(self, decision: RouteDecision, block_hashes: list[str], prompt_tokens: int | None,
                      cached_tokens: int | None) -> bool:
        """The backend's own word on a `prefix` decision (its usage's cached_tokens): when the prefix the index
        promised did not hit, the backend has evicted it, and (its cache being LRU) everything it was sent
        before it too, so its entries up to that one's time expire. True when they did."""
        if decision.reason != PREFIX or not prefix_missed(decision.prefix_depth, len(block_hashes), prompt_tokens,
                                                         cached_tokens):
            return False
        self.expire_prefixes(decision.backend.url, decision.prefix_seen)
        # This request just computed the prompt there again: its chain is cached anew, whatever was skipped.
        spawn(self.store.prefix_record(block_hashes, decision.backend.url))
        return True

    def expire_prefixes(self, backend_url: str, horizon: float) -> None:
        """Entries of `backend_url` recorded at or before `horizon` stop routing (in the store: every replica)."""
        spawn(self.store.prefix_expire(backend_url, horizon))

    async def _route_session(self, session_id: str, current_url: str | None,
                             candidates: list[Backend]) -> RouteDecision:
        current = next((b for b in candidates if b.url == current_url), None)
        target = None
        if current is not None and not (self._queueing(current) and not all(map(self._queueing, candidates))):
            target = rebalance_target(current, candidates, self.config.rebalance_ratio,
                                      self.config.rebalance_min_queue)
            if target is None:
                return RouteDecision(current, SESSION)
        # One placement (or move) at a time in this process: sessions arriving together would otherwise all read
        # the same counts and crowd onto one backend, and a session's parallel requests would each move it.
        # (Replicas may still race; placements are once per session.)
        async with self._placement_lock:
            placed_meanwhile = await self.store.get_session(session_id)
            if placed_meanwhile != current_url:  # a concurrent request of this session placed or moved it
                backend = next((b for b in candidates if b.url == placed_meanwhile), None)
                if backend is not None:
                    return RouteDecision(backend, SESSION)
            if target is not None:
                await self.store.set_session(session_id, target.url, current_url)
                return RouteDecision(target, REBALANCE)
            return await self._place(session_id, current_url, candidates)

    async def _place(self, session_id: str, current_url: str | None, candidates: list[Backend]) -> RouteDecision:
        # Placing or moving: only unsaturated backends, unless every one is.
        eligible = self._unsaturated(candidates) or candidates
        counts = await self.store.session_counts()
        eligible_urls = [b.url for b in eligible]
        chosen_url = bounded_owner(self.ring, session_id, counts, eligible_urls, self.config.load_factor)
        await self.store.set_session(session_id, chosen_url, current_url)
        if current_url is not None:
            reason = FAILOVER
        else:
            owner = next(url for url in self.ring.walk(session_id) if url in eligible_urls)
            reason = SESSION_NEW if chosen_url == owner else BOUNDED
        return RouteDecision(self.by_url[chosen_url], reason)

    def _route_prefix_or_load(self, entries: list[PrefixEntry | None], candidates: list[Backend]) -> RouteDecision:
        entry, depth = longest_match(entries)
        match = next((b for b in candidates if entry and b.url == entry[0]), None)
        if match is not None and depth >= self.config.min_prefix_blocks and not self._saturated(match):
            return RouteDecision(match, PREFIX, depth, entry[1])
        return RouteDecision(min(candidates, key=Backend.load_score), LOAD)

    def _queueing(self, backend: Backend) -> bool:
        """Requests wait on it, by its own /metrics (not inferred from this gateway's in-flight count, which runs
        ahead of a scrape up to an interval old and made every burst look like a queue)."""
        return backend.load.num_waiting >= self.config.saturation_waiting

    def _saturated(self, backend: Backend) -> bool:
        return backend.saturation(self.config.saturation_waiting, self.config.saturation_kv_usage) >= 1.0

    def _unsaturated(self, candidates: list[Backend]) -> list[Backend]:
        return [b for b in candidates if not self._saturated(b)]

    def _next_round_robin(self, candidates: list[Backend]) -> Backend:
        for _ in range(len(self.backends)):
            backend = self.backends[next(self._round_robin)]
            if backend in candidates:
                return backend
        return candidates[0]

    def _why_none(self, exclude: set[str]) -> str:
        states = [f"{b.shown_url}: "
                  f"{'tried' if b.url in exclude else 'down' if not b.healthy else 'breaker ' + b.breaker.state}"
                  for b in self.backends]
        return "no backend is available (" + "; ".join(states) + ")"
