"""Rank 0's side of tensor parallelism: starts the worker processes, joins them, sends them each step, watches
them.

The engine owns its group of ranks: a TCPStore of its own (on a port the kernel picks) and process groups built
from it (tp_process_group.py), never torch's default process group, so two engines live side by side in one
process. Workers run `python -m kvserve.engine.tp_worker` (tp_worker_process.py), whatever the main program is.

A worker that dies or stops answering, before or after the rendezvous, fails the engine within seconds, naming
its rank, its exit status and its last stderr lines. A watcher thread sees a death through the process and a
stop through the worker's heartbeat: a silent worker is killed, so the collectives waiting on it fail at once
instead of after their timeout, and the failure goes to the listeners (an idle server fails its health check
too). A collective that fails raises in the engine's step, which asks `failed()` which worker it was. Closing
stops every worker and waits for it; a worker whose rank 0 is gone exits on its own (its pipes close).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from kvserve.cache.storage.block_copier import BlockCopier
from kvserve.config import EngineConfig
from kvserve.engine.tp_process_group import RankGroup
from kvserve.engine.tp_worker import FAILED, JOINING, READ_BLOCKS, READY, START, STEP, STOP, WRITE_BLOCKS, WorkerStart
from kvserve.engine.tp_worker_process import WorkerProcess

logger = logging.getLogger("kvserve.engine")

# A collective that waits this long on live, heartbeating peers means the group is stuck: fail rather than hang.
# Long, because the ranks load their shards at their own pace before the first one.
COLLECTIVE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0  # from spawning a worker to its first word (importing torch on a busy machine)
STOP_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.1
EXIT_GRACE_S = 2.0  # how long a worker whose pipe broke is given to exit before it is called unresponsive
DEFAULT_WORKER_TIMEOUT_S = 20.0
WORKER_TIMEOUT_ENV = "KVSERVE_TP_WORKER_TIMEOUT_S"


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""


def worker_timeout_s() -> float:
    """How long a worker may be silent (no heartbeat: stopped, frozen) before it fails the engine; also the
    rendezvous' bound once every worker has said it is joining. KVSERVE_TP_WORKER_TIMEOUT_S, in seconds."""
    text = os.environ.get(WORKER_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_WORKER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{WORKER_TIMEOUT_ENV} must be a positive number of seconds; got {text!r}")
    return value


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, size: int, device: torch.device) -> None:
        self.size = size
        self.timeout_s = worker_timeout_s()
        self.failure: str | None = None
        self.ranks: RankGroup | None = None
        self._closing = False
        self._failure_lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        # Kept for the engine's life: NCCL reads it when it builds its communicators, at the first collective.
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, timedelta(seconds=self.timeout_s),
                                    wait_for_workers=False)
        self.processes = [WorkerProcess(rank) for rank in range(1, size)]
        self._watcher = threading.Thread(target=self._watch, name="kvserve-tp-watch", daemon=True)
        self._watcher.start()
        logger.info("tensor parallelism: started %d worker process(es) (pids %s), joining them over %s", size - 1,
                    ", ".join(str(p.pid) for p in self.processes), "nccl" if device.type == "cuda" else "gloo")
        try:
            start = WorkerStart(config, 0, size, self._store.port, self.timeout_s, COLLECTIVE_TIMEOUT_S)
            for worker in self.processes:
                self._send_to(worker, (START, dataclasses.replace(start, rank=worker.rank)))
            self._expect(JOINING, START_TIMEOUT_S)
            self.ranks = self._join(device)
        except BaseException:
            self.close()
            raise

    # ---- start-up ----------------------------------------------------------------------------------------

    def _join(self, device: torch.device) -> RankGroup:
        try:
            return RankGroup.join(self._store, 0, self.size, device, self.timeout_s, COLLECTIVE_TIMEOUT_S)
        except RuntimeError as exc:  # DistStoreError included: a worker died or froze at the rendezvous
            raise self.failed(exc) from None

    def wait_ready(self) -> list[str]:
        """Each worker's pool description once it has built its shard; raises WorkerFailed naming the rank."""
        return self._expect(READY, START_TIMEOUT_S + COLLECTIVE_TIMEOUT_S)

    def _expect(self, kind: str, timeout_s: float) -> list:
        """Every worker's next message, which must be `kind`: its payloads, in rank order."""
        deadline = time.monotonic() + timeout_s
        payloads = []
        for worker in self.processes:
            message = self._receive(worker, deadline)
            if message is None or message[0] != kind:
                raise WorkerFailed(self.failure_message(worker, message))
            payloads.append(message[1])
        return payloads

    def _receive(self, worker: WorkerProcess, deadline: float):
        while not worker.conn.poll(WATCH_INTERVAL_S):
            if self.failure is not None:
                raise WorkerFailed(self.failure)
            if time.monotonic() > deadline:
                raise WorkerFailed(f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) is alive but did "
                                   "not finish starting in time")
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            return None

    # ---- steps -------------------------------------------------------------------------------------------

    def send(self, kind: str, payload=None) -> None:
        for worker in self.processes:
            self._send_to(worker, (kind, payload))

    def _send_to(self, worker: WorkerProcess, message: tuple) -> None:
        try:
            worker.conn.send(message)
        except OSError:
            raise WorkerFailed(self.failure or self.failure_message(worker)) from None

    def send_step(self, inputs) -> None:
        self.send(STEP, inputs)

    def failed(self, exc: BaseException) -> WorkerFailed:
        """The error to raise when a collective failed: which worker died or stopped, if one did."""
        deadline = time.monotonic() + 2.0  # a peer's death is what makes gloo raise: let its exit status arrive
        while self.failure is None and time.monotonic() < deadline:
            dead = next((w for w in self.processes if w.exit_code() is not None), None)
            if dead is not None:
                return WorkerFailed(self.failure_message(dead))
            time.sleep(WATCH_INTERVAL_S)
        return WorkerFailed(self.failure or f"tensor-parallel collective failed: {exc}")

    # ---- failures ----------------------------------------------------------------------------------------

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(message)` (from the watcher thread) when a worker dies or stops answering."""
        self._listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def _watch(self) -> None:
        while not self._closing:
            beating = {w.heartbeat_fd: w for w in self.processes if w.heartbeat_open}
            for fd in wait(list(beating), timeout=WATCH_INTERVAL_S):
                beating[fd].read_heartbeat()
            if self._closing:
                return
            dead = next((w for w in self.processes if w.exit_code() is not None), None)
            if dead is not None:
                return self._fail(self.failure_message(dead))
            silent = next((w for w in self.processes if w.silent_for() > self.timeout_s), None)
            if silent is not None:
                return self._fail_silent(silent)

    def _fail_silent(self, worker: WorkerProcess) -> None:
        message = (f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) stopped answering: no heartbeat "
                   f"for {self.timeout_s:g} s ({WORKER_TIMEOUT_ENV}), process state {worker.describe_state()}; "
                   "it was killed")
        # Recorded first, so the step its death interrupts reports this rather than "killed by signal 9".
        if self._record_failure(message):
            # Killing it makes every collective waiting on it fail now rather than after COLLECTIVE_TIMEOUT_S.
            worker.kill()
            self._notify(message)

    def _fail(self, message: str) -> None:
        if self._record_failure(message):
            self._notify(message)

    def _record_failure(self, message: str) -> bool:
        with self._failure_lock:
            if self.failure is not None or self._closing:
                return False
            self.failure = message
            return True

    def _notify(self, message: str) -> None:
        logger.error("%s", message)
        for listener in self._listeners:
            listener(message)

    def failure_message(self, worker: WorkerProcess, message=None) -> str:
        """What to tell the user about a worker that failed: how it ended (given a moment to end, when its pipe
        broke), its own reason if it sent one, and its last stderr lines."""
        reason = message[1] if message is not None and message[0] == FAILED else None
        code = worker.exit_code_within(EXIT_GRACE_S)
        if code is None:
            status = "stopped answering"
        elif code < 0:
            status = f"was killed by signal {-code}"
        else:
            status = f"exited with code {code}"
        text = f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) {status}"
        text += f": {reason}" if reason else "; the engine cannot continue without it"
        tail = worker.stderr_tail() if code is not None else []
        return text + "".join(f"\n  stderr: {line}" for line in tail)

    # ---- shutdown ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for worker in self.processes:
            try:
                worker.conn.send((STOP, None))
            except OSError:
                pass
        for worker in self.processes:
            worker.stop(STOP_TIMEOUT_S)
        self._watcher.join(timeout=STOP_TIMEOUT_S)
        for worker in self.processes:
            worker.close_pipes()
        if self.ranks is not None:
            self.ranks.close()


class ShardedBlockCopier:
    """BlockCopier across ranks: a block's payload is every rank's part of it, rank 0's first, so the KV tiers
    on rank 0 store and restore whole blocks while each rank keeps only its own KV heads in its pool."""

    def __init__(self, local: BlockCopier, group: TensorParallelGroup) -> None:
        self.local = local
        self.group = group
        self.shards = group.size
        self.payload_bytes = local.payload_bytes * group.size

    def read(self, block_ids: list[int]) -> list[torch.Tensor]:
        if not block_ids:
            return []
        self.group.send(READ_BLOCKS, block_ids)
        parts = self.group.ranks.gather_cpu(self.local.read_joined(block_ids))
        return [row.clone() for row in torch.cat(parts, dim=1)]

    def write(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        if not block_ids:
            return
        assert all(p.numel() == self.payload_bytes for p in payloads), "payload from another layout"
        self.group.send(WRITE_BLOCKS, block_ids)
        parts = [part.contiguous() for part in torch.stack(payloads).split(self.local.payload_bytes, dim=1)]
        mine = self.group.ranks.scatter_cpu(torch.empty_like(parts[0]), parts)
        self.local.write_joined(block_ids, mine)
