"""AsyncLLMEngine: the LLMEngine steps in its own thread; asyncio code submits requests and awaits outputs.

`AsyncLLMEngine.build_in_thread(build)` builds the engine in the thread that will step it, and is how the server
starts one: torch's CPU ops run on an OpenMP thread team per calling thread, and once two threads have run
them (the loader on the main thread, the steps on the engine thread) libgomp manages more threads than there
are cores and stops spinning between parallel regions, so each of a step's few hundred regions waits for its
workers to wake. Measured on 2 cores: a single-stream decode step took 27 ms stepped from a second thread
against 19 ms with every torch op on one thread.

The engine is not thread-safe, so only the engine thread touches it. The event loop talks to it through a
command deque (submit, abort, stop) that the thread drains at the top of every iteration, under a condition
variable the idle thread sleeps on (no busy loop). Outputs go back per request: each request has its own
`RequestStream` (an asyncio.Queue), filled from the engine thread with one `loop.call_soon_threadsafe` per
step for the whole batch.

Failure rules: a request is never left hanging. A rejected submission raises from `RequestStream.accepted()`;
an exception inside `step()` is delivered to every in-flight request; a stopped or dead engine fails whatever is
still waiting. Abort (client gone) frees the request's blocks at the top of the next iteration, i.e. within
one engine step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.llm_engine import EngineStats, LLMEngine, RequestRejected
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.tp_group import WorkerFailed

logger = logging.getLogger("kvserve.engine.async")

WORKER_FAILURE_GRACE_S = 5.0


class EngineError(RuntimeError):
    """The engine failed while serving the request (a bug or a device error, not the request's fault)."""


class EngineDeadError(EngineError):
    """The engine thread has stopped after a failure; nothing more can be served."""


class EngineStoppedError(EngineError):
    """The engine was shut down before the request finished."""


class QueueFullError(RuntimeError):
    """--max-waiting-requests requests are already waiting; try again later."""


class DrainingError(RuntimeError):
    """The server is shutting down and admits no new requests."""


class RequestCancelled(Exception):
    """The request was aborted from this side (client disconnect) while someone was still awaiting it."""


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # finishing what it has, admitting nothing
    STOPPED = "stopped"
    DEAD = "dead"


@dataclass(slots=True)
class RequestTiming:
    """Engine-clock (time.monotonic) timestamps of one request, for latency histograms."""

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_output_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    def record(self, output: RequestOutput, now: float) -> None:
        self.arrival_time = output.arrival_time
        self.first_token_time = output.first_token_time
        self.finished_time = output.finished_time
        if self.last_output_time is not None and any(o.delta_token_ids for o in output.outputs):
            self.inter_token_latencies.append(now - self.last_output_time)
        self.last_output_time = now


@dataclass(slots=True, frozen=True)
class PoolCensus:
    """Blocks by state: used (ref > 0), cached (ref 0, hash kept, evictable), free (ref 0, no hash)."""

    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int
    num_evictions: int  # cumulative: cached blocks whose hash was dropped to reuse the block


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each iteration; readers on other threads never touch the engine."""

    stats: EngineStats
    census: PoolCensus
    num_aborted: int  # children aborted while unfinished (client disconnects, shutdown), for request_success
    taken_at: float


@dataclass(slots=True)
class _Submit:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    session_id: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Fail:
    """Something outside a step killed the engine (a tensor-parallel worker died while it was idle)."""

    error: BaseException


@dataclass(slots=True)
class _Stop:
    pass


_Command = _Submit | _Abort | _Stop
_ACCEPTED = object()


class RequestStream:
    """One request's outputs, in order. Iterate it; always `close()` it (idempotent) when done.

    Outputs the consumer has not picked up yet are merged into one (deltas concatenated, cumulative fields from
    the newest), so a slow client holds at most one pending output instead of one per engine step.
    """

    def __init__(self, request_id: str, num_children: int, engine: "AsyncLLMEngine",
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.num_children = num_children
        self.timing = RequestTiming()
        self.finished = False  # the final output (or an error) was received
        self.last_output: RequestOutput | None = None  # engine-thread side: the latest output handed over
        self._engine = engine
        self._loop = loop
        self._pending: deque[object] = deque()
        self._ready = asyncio.Event()
        self._closed = False

    async def accepted(self) -> None:
        """Waits until the engine has queued the request; raises RequestRejected (or an engine error) if not."""
        item = await self._get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is _ACCEPTED

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Aborts the request in the engine unless it finished, and wakes anyone still awaiting it."""
        if self._closed:
            return
        if not self.finished:
            self._engine.abort(self.request_id)
            self._append(RequestCancelled(f"request {self.request_id} was cancelled"))
        self._closed = True
        self._engine.release(self)

    async def _get(self) -> object:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()

    # Called on the event loop thread only (scheduled from the engine thread).
    def _put(self, item: object) -> None:
        if self._closed:
            return
        tail = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(tail, RequestOutput):
            self._pending[-1] = _merge_outputs(tail, item)
        else:
            self._append(item)

    def _append(self, item: object) -> None:
        self._pending.append(item)
        self._ready.set()


def _merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` carrying the deltas of both (newer is a fresh object from the engine, ours to change)."""
    for old_choice, new_choice in zip(older.outputs, newer.outputs):
        new_choice.delta_text = old_choice.delta_text + new_choice.delta_text
        new_choice.delta_token_ids = old_choice.delta_token_ids + new_choice.delta_token_ids
        if new_choice.delta_logprobs is not None:
            new_choice.delta_logprobs = (old_choice.delta_logprobs or []) + new_choice.delta_logprobs
    return newer


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.state = EngineState.RUNNING
        self.failure: BaseException | None = None
        self._commands: deque[_Command] = deque()
        self._wakeup = threading.Condition(threading.RLock())
        self._num_unadmitted_children = 0  # submitted, not yet drained by the engine thread (guarded by _wakeup)
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._open_streams: set[RequestStream] = set()  # owned by the event loop: submitted, not yet closed
        self._num_aborted = 0  # engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._started = False
        self._go = threading.Event()  # lets a thread from build_in_thread begin stepping
        self.snapshot = self._make_snapshot()
        # Called (from the engine thread) with the error once the engine is dead: the server exits on it.
        self.on_dead: list[Callable[[BaseException], None]] = []

    # ---- lifecycle ---------------------------------------------------------------------------------------

    @classmethod
    def build_in_thread(cls, build: Callable[[], LLMEngine], max_waiting_requests: int | None = None
                        ) -> "AsyncLLMEngine":
        """Runs `build()` in a new engine thread and returns once it has built the engine (raising what it
        raised); the same thread steps the engine after `start()` (see the module docstring for why)."""
        built: concurrent.futures.Future[AsyncLLMEngine] = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                async_engine = cls(build(), max_waiting_requests)
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(async_engine)
            async_engine._go.wait()
            async_engine._run()

        thread = threading.Thread(target=build_then_run, name="kvserve-engine", daemon=True)
        thread.start()
        async_engine = built.result()
        async_engine._thread = thread
        return async_engine

    def start(self) -> None:
        """Starts stepping in the engine thread (idempotent)."""
        if self._started:
            return
        self._started = True
        tp = getattr(self.engine, "tp", None)
        if tp is not None:
            tp.on_failure(self._worker_failed)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()
        self._go.set()

    @property
    def is_alive(self) -> bool:
        running = self.state in (EngineState.RUNNING, EngineState.DRAINING)
        return running and self._started and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose streams are still open (event loop side)."""
        return len(self._open_streams)

    def stop_admitting(self) -> None:
        if self.state is EngineState.RUNNING:
            self.state = EngineState.DRAINING

    async def shutdown(self, grace_period_s: float = 0.0) -> None:
        """`stop`, then `close` (whatever stop did). The server calls the two itself, closing its request log in
        between."""
        try:
            await self.stop(grace_period_s)
        finally:
            await self.close()

    async def stop(self, grace_period_s: float = 0.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `grace_period_s`, then abort the rest and stop
        the engine thread. No request runs after this."""
        self.stop_admitting()
        deadline = time.monotonic() + grace_period_s
        while self.num_in_flight and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.02)
        self._push(_Stop())
        self._go.set()  # a thread from build_in_thread that was never started still has to see the stop
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED

    async def close(self) -> None:
        """After stop: the engine saves its KV tiers (up to --kv-disk-save-timeout) and stops its tensor-parallel
        workers. Skipped while the engine thread still runs (a step that did not return), which owns them."""
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self.engine.close)

    # ---- requests (event loop side) --------------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None = None, session_id: str | None = None) -> RequestStream:
        """Queues a request; await `stream.accepted()` next. Raises at once if the engine cannot take it."""
        stream = RequestStream(request_id, params.n, self, asyncio.get_running_loop())
        with self._wakeup:
            # Checked under the lock the engine thread takes to stop: a submission either gets in before the stop
            # (and is failed by it) or sees the new state here; none is left unanswered in between.
            self._check_admitting()
            self._check_queue_room(params.n)
            self._push(_Submit(stream, list(prompt_token_ids), params, cache_salt, session_id), num_children=params.n)
        self._open_streams.add(stream)
        return stream

    def _check_admitting(self) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine has stopped after an error: {self.failure!r}")
        if self.state is not EngineState.RUNNING:
            raise DrainingError("the server is shutting down and accepts no new requests")

    def _check_queue_room(self, num_children: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        waiting = self.snapshot.stats.num_waiting + self._num_unadmitted_children
        if waiting + num_children > limit and waiting > 0:
            # `waiting > 0`: one request with n above the limit is still served when the queue is empty.
            raise QueueFullError(f"{waiting} requests are waiting (--max-waiting-requests {limit}); retry later")

    def _worker_failed(self, message: str) -> None:
        """From the tensor-parallel watcher thread. The engine thread fails the engine at its next iteration;
        if it cannot (stuck in a collective that does not notice a dead peer, as NCCL's may not), the engine
        is declared dead from here after WORKER_FAILURE_GRACE_S, so /health and the server still react."""
        error = WorkerFailed(message)
        self._push(_Fail(error))

        def declare_dead() -> None:
            if self.state is not EngineState.DEAD:
                logger.error("the engine thread did not stop after the worker failure; declaring the engine dead")
                self._die(error)

        timer = threading.Timer(WORKER_FAILURE_GRACE_S, declare_dead)
        timer.daemon = True
        timer.start()

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to abort a request (its stream's close does, unless it finished)."""
        self._push(_Abort(request_id))

    def release(self, stream: RequestStream) -> None:
        """A closed stream leaves the set shutdown must cancel."""
        self._open_streams.discard(stream)

    def _push(self, command: _Command, num_children: int = 0) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._num_unadmitted_children += num_children
            self._wakeup.notify()

    # ---- the engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug in this loop: never leave requests hanging
            logger.exception("engine thread crashed")
            self._die(exc)

    def _iterate(self) -> bool:
        """One loop iteration: apply commands, step once if there is work. False when told to stop."""
        for command in self._take_commands():
            if isinstance(command, _Stop):
                self._stop_all()
                return False
            if isinstance(command, _Fail):
                logger.error("the engine cannot continue: %s", command.error)
                self._fail_in_flight(command.error, fatal=True)
                return False
            self._apply(command)
        if self.engine.has_unfinished_requests():
            self._step()
        else:
            self.engine.offload_idle_sessions()
        self._publish()
        return self.state is not EngineState.DEAD

    def _take_commands(self) -> list[_Command]:
        with self._wakeup:
            while not self._commands and not self.engine.has_unfinished_requests():
                wait = self.engine.idle_offload_wait()  # idle sessions fall due even when nothing arrives
                if wait is not None and wait <= 0:
                    break
                self._wakeup.wait(wait)
            commands = list(self._commands)
            self._commands.clear()
            self._num_unadmitted_children -= sum(c.params.n for c in commands if isinstance(c, _Submit))
            return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                self._num_aborted += _unfinished_children(stream)
                self.engine.abort_request(command.request_id)
            return
        assert isinstance(command, _Submit)
        stream = command.stream
        try:
            self.engine.add_request(stream.request_id, command.prompt_token_ids, command.params, command.cache_salt,
                                    command.session_id)
        except RequestRejected as exc:
            self._deliver([(stream, exc)])
            return
        except Exception as exc:  # the engine should have rejected it cleanly; report, do not crash the loop
            logger.exception("engine.add_request failed for %s", stream.request_id)
            self._deliver([(stream, EngineError(f"the engine could not queue the request: {exc}"))])
            return
        self._streams[stream.request_id] = stream
        self._deliver([(stream, _ACCEPTED)])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d in-flight requests", len(self._streams))
            self._fail_in_flight(exc)
            return
        now = time.monotonic()
        batch: list[tuple[RequestStream, object]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted this iteration
            if stream.timing.first_scheduled_time is None:
                stream.timing.first_scheduled_time = output.first_scheduled_time
            stream.timing.record(output, now)
            stream.last_output = output
            if output.finished:
                del self._streams[output.request_id]
            batch.append((stream, output))
        self._deliver(batch)

    def _fail_in_flight(self, exc: BaseException, fatal: bool = False) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        error = EngineError(f"the engine failed while running this request: {exc!r}")
        self._deliver([(stream, error) for stream in streams])
        healthy = not fatal and not isinstance(exc, WorkerFailed)  # a lost worker cannot be stepped again
        try:
            self.engine.abort_request([s.request_id for s in streams])
            healthy = healthy and not self.engine.has_unfinished_requests()
        except Exception:
            logger.exception("could not abort requests after the failure")
            healthy = False
        if not healthy:
            self._die(exc)

    def _stop_all(self) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        if streams:
            logger.warning("stopping the engine with %d requests unfinished; aborting them", len(streams))
            for stream in streams:
                self._num_aborted += _unfinished_children(stream)
            self.engine.abort_request([s.request_id for s in streams])
        self._deliver([(s, EngineStoppedError("the server shut down before the request finished")) for s in streams])
        self._close_queue(EngineState.STOPPED, EngineStoppedError("the server shut down before the request started"))
        self._publish()

    def _die(self, exc: BaseException) -> None:
        self.failure = exc
        error = EngineDeadError(f"the engine has stopped after an error: {exc!r}")
        self._close_queue(EngineState.DEAD, error)
        for listener in self.on_dead:
            listener(exc)
        streams = list(self._streams.values())
        self._streams.clear()
        self._deliver([(s, error) for s in streams])

    def _close_queue(self, final_state: EngineState, error: BaseException) -> None:
        """Enters the final state and fails every submission still queued, atomically with respect to submit()."""
        with self._wakeup:
            if self.state is not EngineState.DEAD:
                self.state = final_state
            commands = list(self._commands)
            self._commands.clear()
            self._num_unadmitted_children = 0
        self._deliver([(c.stream, error) for c in commands if isinstance(c, _Submit)])

    def _deliver(self, batch: list[tuple[RequestStream, object]]) -> None:
        """Hands items to their streams on the event loop: one thread-safe call per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for stream, item in batch:
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting any more

    def _publish(self) -> None:
        self.snapshot = self._make_snapshot()

    def _make_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.engine.stats(), self._take_census(), self._num_aborted, time.monotonic())

    def _take_census(self) -> PoolCensus:
        kv_cache = self.engine.kv_cache
        num_used = kv_cache.num_blocks - kv_cache.num_free_blocks
        num_cached = kv_cache.num_evictable_cached_blocks  # in the free queue, still holding a reusable prefix
        return PoolCensus(num_used, num_cached, kv_cache.num_free_blocks - num_cached, kv_cache.stats.evictions)


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream._put(item)


def _unfinished_children(stream: RequestStream) -> int:
    if stream.last_output is None:
        return stream.num_children
    return sum(1 for o in stream.last_output.outputs if o.finish_reason is None)
