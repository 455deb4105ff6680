"""One engine's tensor-parallel ranks: torch process groups built from a store the engine owns.

torch's default process group is one per process, so an engine that took it would keep a second engine (two
models compared in a notebook) from starting. Each engine builds its own groups from its own store and calls
their collectives directly (torch.distributed's functions only accept groups that hang off the default one);
closing the engine shuts them down. Gloo carries CPU tensors (the pool size agreement, block payloads) and, on
CPU, the forward's tensors too; NCCL carries the forward's tensors on CUDA.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class RankGroup:
    def __init__(self, rank: int, size: int, cpu_group, device_group, collective_timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self._cpu = cpu_group
        self._device = device_group
        self._timeout = timedelta(seconds=collective_timeout_s)

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device, join_timeout_s: float,
             collective_timeout_s: float) -> "RankGroup":
        """Blocks until every rank has joined, for at most `join_timeout_s` (connecting is what times out)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL works on the current device
        join_timeout = timedelta(seconds=join_timeout_s)
        cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, join_timeout)
        device_group = cpu_group
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=collective_timeout_s)
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
        return cls(rank, size, cpu_group, device_group, collective_timeout_s)

    # ---- the forward's collectives (TensorShard.group) ------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        self._all_reduce(self._device, x, op)
        return x

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank `dst`, in rank order; None on the other ranks."""
        return self._gather(self._device, x, dst)

    # ---- CPU tensors ----------------------------------------------------------------------------------------

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest blocks any rank can hold (each rank measures its own device)."""
        value = torch.tensor([num_blocks], dtype=torch.long)
        self._all_reduce(self._cpu, value, dist.ReduceOp.MIN)
        return int(value.item())

    def gather_cpu(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        return self._gather(self._cpu, x, dst)

    def scatter_cpu(self, out: torch.Tensor, parts: list[torch.Tensor] | None, src: int = 0) -> torch.Tensor:
        """Rank `src` sends parts[r] to rank r; every rank receives its part into `out`."""
        options = self._options(dist.ScatterOptions)
        options.rootRank = src
        self._cpu.scatter([out], [parts] if self.rank == src else [], options).wait()
        return out

    # ---- the calls ------------------------------------------------------------------------------------------

    def _all_reduce(self, group, x: torch.Tensor, op: dist.ReduceOp) -> None:
        options = self._options(dist.AllreduceOptions)
        options.reduceOp = op
        group.allreduce([x], options).wait()

    def _gather(self, group, x: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        options = self._options(dist.GatherOptions)
        options.rootRank = dst
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
        group.gather([parts] if parts is not None else [], [x], options).wait()
        return parts

    def _options(self, kind):
        options = kind()
        options.timeout = self._timeout  # a collective waits this long for a live peer; dead ones fail it at once
        return options

    def close(self) -> None:
        for group in {id(g): g for g in (self._device, self._cpu)}.values():
            group.shutdown()
