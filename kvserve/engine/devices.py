"""Which device and how many CPU threads an engine rank computes on."""

from __future__ import annotations

import os

import torch

from kvserve.config import EngineConfig


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, built "
                             f"{'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for CPU only'})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: torch sees {count} CUDA device(s), numbered from 0")
    return device


def rank_device(config: EngineConfig, rank: int):
    device = pick_device(config.device)
    if device.type == "cpu":
        return device
    size = config.parallel.tensor_parallel_size
    if torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    return torch.device("cuda", rank)


def cpu_threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)
