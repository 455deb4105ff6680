"""A tensor-parallel worker process (ranks 1..N-1): builds its shard, then runs what rank 0 sends it.

Rank 0 sends each message down a multiprocessing pipe; the tensors of a step move through torch.distributed
collectives inside the forward (all-reduce, gather). Waiting for the next message is a blocking pipe read,
not a collective, so an idle server never trips the collectives' timeout; and when rank 0 goes away, however
it dies, the pipe closes and the worker exits instead of living on as an orphan.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.model.tensor_parallel import TensorShard


# Messages from rank 0: (kind, payload).
STEP, READ_BLOCKS, WRITE_BLOCKS, STOP = "step", "read_blocks", "write_blocks", "stop"
READY, FAILED = "ready", "failed"


def init_distributed(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    from datetime import timedelta

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))


def cpu_group():
    """The group CPU tensors (block payloads) travel in: the default one under gloo, a gloo one beside NCCL."""
    return None if dist.get_backend() == "gloo" else _gloo_group()


_GLOO = []


def _gloo_group():
    if not _GLOO:
        _GLOO.append(dist.new_group(backend="gloo"))
    return _GLOO[0]


def agree_num_blocks(num_blocks: int) -> int:
    value = torch.tensor([num_blocks], dtype=torch.long)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=cpu_group())
    return int(value.item())


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    from kvserve.engine.llm_engine import pick_device

    device = pick_device(config.device)
    if device.type == "cpu":
        return device
    size = config.parallel.tensor_parallel_size
    if torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    return torch.device("cuda", rank)


def cpu_threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def worker_main(config: EngineConfig, rank: int, size: int, init_method: str, timeout_s: float,
                conn: Connection) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    try:
        device = rank_device(config, rank)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size))
        init_distributed(rank, size, init_method, device, timeout_s)
        from kvserve.engine.rank_state import build_rank

        state = build_rank(config, device, TensorShard(rank, size), agree_num_blocks)
        conn.send((READY, state.describe_pool()))
        _serve(state, conn)
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
        # A normal exit (not os._exit) runs the finalizers, so the resource tracker sees no leaked semaphore.
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(state, conn: Connection) -> None:
    from kvserve.cache.block_copier import BlockCopier

    copier = None
    while True:
        kind, payload = conn.recv()
        if kind == STEP:
            state.runner.run(payload)
        elif kind in (READ_BLOCKS, WRITE_BLOCKS):
            copier = copier or BlockCopier(state.storage)
            if kind == READ_BLOCKS:
                dist.gather(copier.read_joined(payload), None, dst=0, group=cpu_group())
            else:
                part = torch.empty(len(payload), copier.payload_bytes, dtype=torch.uint8)
                dist.scatter(part, None, src=0, group=cpu_group())
                copier.write_joined(payload, part)
        elif kind == STOP:
            return
