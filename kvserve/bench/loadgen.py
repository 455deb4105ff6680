"""Drives a workload against a server: closed loop or open loop, measured request by request.

Closed loop (no --request-rate): --max-concurrency sessions are active at once (users); each sends its turns
one after another (after its think time), and a finished session is replaced by the next at once. With
single-turn workloads that is exactly --max-concurrency requests in flight.
Open loop (--request-rate R): sessions arrive at rate R (Poisson or gamma) whatever the server's speed;
--max-concurrency, if given, caps the requests in flight (the rest wait in the client; as in vLLM's benchmark,
that wait is not part of their latency).
The run ends after --num-requests requests or --duration seconds (no new request starts after it; those in
flight finish), whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvserve.bench.arrivals import arrivals
from kvserve.bench.client import CHAT, Target, send_request
from kvserve.bench.prompts import chat_messages, completion_prompt
from kvserve.bench.records import RequestRecord
from kvserve.bench.sessions import Session, Workload


@dataclass(slots=True)
class LoadShape:
    request_rate: float = math.inf  # sessions per second; inf: closed loop
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None

    def __post_init__(self) -> None:
        assert self.num_requests is not None or self.duration_s is not None, "a run needs an end"
        assert self.request_rate > 0 and self.burstiness > 0
        assert self.max_concurrency is None or self.max_concurrency >= 1

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.request_rate)


@dataclass(slots=True)
class RequestBudget:
    """How many more requests may start: whole sessions are reserved up front, so an open-loop run does not
    start more sessions than it can finish."""

    limit: int | None
    deadline: float | None  # perf_counter
    reserved: int = 0

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def exhausted(self) -> bool:
        return self.expired() or (self.limit is not None and self.reserved >= self.limit)

    def reserve(self, wanted: int) -> int:
        if self.exhausted():
            return 0
        granted = wanted if self.limit is None else min(wanted, self.limit - self.reserved)
        self.reserved += granted
        return granted


@dataclass(slots=True)
class LoadRun:
    records: list[RequestRecord]
    elapsed_s: float  # from the run's start until its last request ended
    started_at: float  # perf_counter at the start; request times are relative to it


@dataclass(slots=True)
class LoadGenerator:
    http: httpx.AsyncClient
    target: Target
    workload: Workload
    timeout_s: float
    seed: int = 0
    on_record: Callable[[RequestRecord], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    started_at: float = 0.0

    async def run(self, shape: LoadShape, first_session: int = 0) -> LoadRun:
        self.records = []
        self.started_at = time.perf_counter()
        deadline = None if shape.duration_s is None else self.started_at + shape.duration_s
        budget = RequestBudget(shape.num_requests, deadline)
        indices = itertools.count(first_session)
        if shape.closed_loop:
            await self._closed_loop(shape, budget, indices)
        else:
            await self._open_loop(shape, budget, indices)
        elapsed = time.perf_counter() - self.started_at
        return LoadRun(sorted(self.records, key=lambda r: r.start_s), elapsed, self.started_at)

    async def _closed_loop(self, shape: LoadShape, budget: RequestBudget, indices) -> None:
        num_users = shape.max_concurrency or shape.num_requests
        assert num_users, "a closed loop without --max-concurrency needs --num-requests (all at once)"

        async def user() -> None:
            while not budget.exhausted():
                session = self.workload.session(next(indices))
                await self._session(session, budget.reserve(len(session.turns)), budget, None)

        await asyncio.gather(*(user() for _ in range(num_users)))

    async def _open_loop(self, shape: LoadShape, budget: RequestBudget, indices) -> None:
        gate = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
        tasks: list[asyncio.Task] = []
        async for due in arrivals(shape.request_rate, shape.burstiness, self.seed):
            session = self.workload.session(next(indices))
            num_turns = budget.reserve(len(session.turns))
            if num_turns == 0:
                break
            scheduled_s = due - self.started_at
            tasks.append(asyncio.create_task(self._session(session, num_turns, budget, gate, scheduled_s)))
            if budget.exhausted():
                break  # rather than wait for one more arrival that would not be sent
        await asyncio.gather(*tasks)

    async def _session(self, session: Session, num_turns: int, budget: RequestBudget,
                       gate: asyncio.Semaphore | None, scheduled_s: float | None = None) -> None:
        replies: list[str] = []
        for turn_index in range(num_turns):
            turn = session.turns[turn_index]
            if turn_index > 0 and turn.delay_s > 0:
                await asyncio.sleep(turn.delay_s)
            if budget.expired():
                return
            async with gate or contextlib.nullcontext():
                record = await self._send(session, turn_index, replies, scheduled_s if turn_index == 0 else None)
            if not record.ok:
                return  # a conversation cannot go on without the answer it would resend
            replies.append(record.output_text)

    async def _send(self, session: Session, turn_index: int, replies: list[str],
                    scheduled_s: float | None) -> RequestRecord:
        render = chat_messages if self.target.endpoint == CHAT else completion_prompt
        payload = render(session, turn_index, replies)
        record = RequestRecord(session.index, turn_index, time.perf_counter() - self.started_at,
                               session.turns[turn_index].max_tokens, scheduled_s=scheduled_s)
        await send_request(self.http, self.target, record, payload, self.timeout_s)
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return record
