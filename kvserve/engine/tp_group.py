"""Rank 0's side of tensor parallelism: starts the worker processes, sends them each step, watches them.

Workers are spawned (torch.multiprocessing's `spawn`: a fresh interpreter, never a fork of a process holding
threads and a device context) and joined with torch.distributed, gloo on CPU and NCCL on CUDA. A worker that
dies fails the engine with a message naming its rank: a collective waiting on it raises (gloo sees the closed
connection), and a watcher thread reports a death that happens between steps, so an idle server fails its
health check too. Closing stops every worker and waits for it; the workers are daemonic, so even an engine
that never closes leaves no process behind when the interpreter exits.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.cache.block_copier import BlockCopier
from kvserve.config import EngineConfig
from kvserve.engine.tp_worker import (
    FAILED, READ_BLOCKS, READY, STEP, STOP, WRITE_BLOCKS, cpu_group, init_distributed, worker_main,
)

logger = logging.getLogger("kvserve.engine")

# A collective that waits this long for a live peer means the group is stuck: fail rather than hang forever.
COLLECTIVE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0  # from spawning a worker to its first word
STOP_TIMEOUT_S = 10.0


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, size: int, device: torch.device) -> None:
        self.size = size
        self.failure: str | None = None
        self._closing = False
        self._listeners: list[Callable[[str], None]] = []
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.processes = []
        for rank in range(1, size):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker_main, name=f"kvserve-tp-rank{rank}", daemon=True,
                                      args=(config, rank, size, init_method, COLLECTIVE_TIMEOUT_S, child_end))
            process.start()
            child_end.close()
            self.pipes.append(parent_end)
            self.processes.append(process)
        logger.info("tensor parallelism: started %d worker process(es) (pids %s), joining them over %s", size - 1,
                    ", ".join(str(p.pid) for p in self.processes), "nccl" if device.type == "cuda" else "gloo")
        try:
            init_distributed(0, size, init_method, device, COLLECTIVE_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name="kvserve-tp-watch", daemon=True).start()

    # ---- start-up ----------------------------------------------------------------------------------------

    def wait_ready(self) -> list[str]:
        """Each worker's pool description once it has built its shard; raises WorkerFailed naming the rank."""
        descriptions = []
        for rank, pipe in enumerate(self.pipes, start=1):
            message = self._receive(rank, pipe)
            if message is None or message[0] != READY:
                raise WorkerFailed(self.failure_message(rank, message))
            descriptions.append(message[1])
        return descriptions

    def _receive(self, rank: int, pipe: Connection):
        process = self.processes[rank - 1]
        ready = wait([pipe, process.sentinel], timeout=START_TIMEOUT_S + COLLECTIVE_TIMEOUT_S)
        if pipe in ready:
            try:
                return pipe.recv()
            except (EOFError, OSError):
                return None
        return None

    # ---- steps -------------------------------------------------------------------------------------------

    def send(self, kind: str, payload=None) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send((kind, payload))
            except OSError:
                raise WorkerFailed(self.failure_message(rank)) from None

    def send_step(self, inputs) -> None:
        self.send(STEP, inputs)

    def failed(self, exc: BaseException) -> WorkerFailed:
        """The error to raise when a collective failed: which worker died, if one did."""
        for process in self.processes:
            process.join(timeout=2.0)  # a peer's death is what makes gloo raise: let its exit code arrive
        dead = [rank for rank, p in enumerate(self.processes, start=1) if _exit_code(p) is not None]
        if dead:
            return WorkerFailed(self.failure_message(dead[0]))
        return WorkerFailed(f"tensor-parallel collective failed: {exc}")

    # ---- failures ----------------------------------------------------------------------------------------

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(message)` (from a watcher thread) when a worker dies outside a step."""
        self._listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self.processes[rank - 1].join(timeout=1.0)
        self.failure = self.failure_message(rank)
        logger.error("%s", self.failure)
        for listener in self._listeners:
            listener(self.failure)

    def failure_message(self, rank: int, message=None) -> str:
        process = self.processes[rank - 1]
        pipe = self.pipes[rank - 1]
        if message is None:
            try:
                message = pipe.recv() if pipe.poll() else None
            except (EOFError, OSError):
                message = None
        reason = message[1] if message is not None and message[0] == FAILED else None
        code = _exit_code(process)
        if code is None:
            status = "stopped answering"
        elif code < 0:
            status = f"was killed by signal {-code}"
        else:
            status = f"exited with code {code}"
        text = f"tensor-parallel worker rank {rank} (pid {process.pid}) {status}"
        return text + (f": {reason}" if reason else "; the engine cannot continue without it")

    # ---- shutdown ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for pipe in self.pipes:
            try:
                pipe.send((STOP, None))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=STOP_TIMEOUT_S)
        for pipe in self.pipes:
            pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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
        mine = self.local.read_joined(block_ids)
        parts = [torch.empty_like(mine) for _ in range(self.shards)]
        dist.gather(mine, parts, dst=0, group=cpu_group())
        return [row.clone() for row in torch.cat(parts, dim=1)]

    def write(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        if not block_ids:
            return
        assert all(p.numel() == self.payload_bytes for p in payloads), "payload from another layout"
        self.group.send(WRITE_BLOCKS, block_ids)
        parts = [part.contiguous() for part in torch.stack(payloads).split(self.local.payload_bytes, dim=1)]
        mine = torch.empty_like(parts[0])
        dist.scatter(mine, parts, src=0, group=cpu_group())
        self.local.write_joined(block_ids, mine)


def _exit_code(process, settle_s: float = 0.5) -> int | None:
    """The process's exit code, or None while it runs. Two threads may reap a dead worker at once (the watcher
    and a step whose collective failed): the one that loses the race reads None for a moment, until the other
    has stored the code, so a None is read again for up to `settle_s`."""
    deadline = time.monotonic() + settle_s
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return code
