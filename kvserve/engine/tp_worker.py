"""A tensor-parallel worker process (ranks 1..N-1): builds its shard, then runs what rank 0 sends it.

Started by rank 0 as `python -m kvserve.engine.tp_worker CONN_FD HEARTBEAT_FD` (see tp_worker_process.py). Its
heartbeat starts before anything heavy is imported, so rank 0 hears from it within a second of its start. The
first message says what to build and where the engine's store is; the worker announces that it is joining,
joins the engine's own process group, builds its shard and says it is ready.

Rank 0 sends each message down a multiprocessing pipe; the tensors of a step move through the group's
collectives inside the forward (all-reduce, gather). Waiting for the next message is a blocking pipe read, not a
collective, so an idle server never trips the collectives' timeout; and when rank 0 goes away, however it dies,
the pipe closes (and the heartbeat's write fails) and the worker exits instead of living on as an orphan.
"""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvserve.config import EngineConfig
from kvserve.engine.tp_heartbeat import start_heartbeat

# Messages from rank 0: (kind, payload).
START, STEP, READ_BLOCKS, WRITE_BLOCKS, STOP = "start", "step", "read_blocks", "write_blocks", "stop"
# Messages to rank 0.
JOINING, READY, FAILED = "joining", "ready", "failed"


@dataclass(slots=True, frozen=True)
class WorkerStart:
    """The first message: what this rank builds, and how it joins the engine's group."""

    config: EngineConfig
    rank: int
    size: int
    store_port: int  # the engine's own TCPStore, on 127.0.0.1
    join_timeout_s: float
    collective_timeout_s: float


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[1]))
    start_heartbeat(int(argv[2]))
    try:
        kind, start = conn.recv()
    except (EOFError, KeyboardInterrupt):
        return  # rank 0 is gone before it said anything
    assert kind == START, kind
    run_worker(start, conn)


def run_worker(start: WorkerStart, conn: Connection) -> None:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank{start.rank} %(name)s: %(message)s")
    from kvserve.engine.devices import rank_device  # torch: after the heartbeat has started

    group = None
    try:
        device = rank_device(start.config, start.rank)
        group = _join(start, device, conn)
        state = _build(start, device, group)
        conn.send((READY, state.describe_pool()))
        _serve(state, group, conn)
    except (EOFError, KeyboardInterrupt):
        return  # rank 0 is gone: nothing to report to
    except BaseException as exc:  # report to rank 0, then die: rank 0 fails with this message
        traceback.print_exc(file=sys.stderr)
        try:
            conn.send((FAILED, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if group is not None:
            group.close()


def _join(start: WorkerStart, device, conn: Connection):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from kvserve.engine.devices import cpu_threads_per_rank
    from kvserve.engine.tp_process_group import RankGroup

    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(start.size))
    conn.send((JOINING, None))
    store = dist.TCPStore("127.0.0.1", start.store_port, start.size, False, timedelta(seconds=start.join_timeout_s))
    return RankGroup.join(store, start.rank, start.size, device, start.join_timeout_s, start.collective_timeout_s)


def _build(start: WorkerStart, device, group):
    from kvserve.engine.rank_state import build_rank
    from kvserve.model.tensor_parallel import TensorShard

    return build_rank(start.config, device, TensorShard(start.rank, start.size, group), group.agree_num_blocks)


def _serve(state, group, conn: Connection) -> None:
    import torch

    from kvserve.cache.storage.block_copier import BlockCopier

    copier = None
    while True:
        kind, payload = conn.recv()
        if kind == STEP:
            state.runner.run(payload)
        elif kind in (READ_BLOCKS, WRITE_BLOCKS):
            copier = copier or BlockCopier(state.storage)
            if kind == READ_BLOCKS:
                group.gather_cpu(copier.read_joined(payload))
            else:
                part = torch.empty(len(payload), copier.payload_bytes, dtype=torch.uint8)
                group.scatter_cpu(part, None)
                copier.write_joined(payload, part)
        elif kind == STOP:
            return


if __name__ == "__main__":
    main(sys.argv)
