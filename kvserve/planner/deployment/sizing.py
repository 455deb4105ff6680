"""What a plan asks of the pod around the GPU: host memory for the host KV tier, disk for the disk tier, and
how long the startup probe waits. Round numbers from the plan's own figures; each choice says why."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.plan import Plan

GIB = 1024**3
# The host tier holds one more pool's worth of idle sessions' blocks: a returning session loads instead of
# recomputing while the pool serves others.
HOST_TIER_POOLS = 1
# The disk tier holds more (it survives restarts): four pools' worth.
DISK_TIER_POOLS = 4
# Host memory besides the host tier: the weights pass through it while loading, plus CUDA and Python.
HOST_OVERHEAD_GIB = 8
# Start-up: weights read from a network volume at ~200 MiB/s, plus CUDA init and the memory profile.
LOAD_MIB_PER_S = 200
STARTUP_FIXED_S = 120
MIN_STARTUP_S = 600  # never less than the base's budget
STARTUP_PERIOD_S = 10
ENGINE_CPUS = 8  # tokenization, detokenization and the scheduler run on the CPU beside each GPU


@dataclass(slots=True, frozen=True)
class PodSizing:
    host_tier_gib: int
    disk_tier_gib: int
    volume_gib: int  # the disk tier plus room (the tier counts payload; files have headers, the FS its own)
    memory_gib: int
    startup_failure_threshold: int
    cpus: int = ENGINE_CPUS

    @property
    def startup_budget_s(self) -> int:
        return self.startup_failure_threshold * STARTUP_PERIOD_S


def pod_sizing(plan: Plan) -> PodSizing:
    pool_gib = max(1, math.ceil(plan.pool_bytes / GIB))
    weights_gib = plan.weights.per_gpu_bytes / GIB
    host = HOST_TIER_POOLS * pool_gib
    disk = DISK_TIER_POOLS * pool_gib
    startup_s = max(MIN_STARTUP_S, math.ceil(weights_gib * 1024 / LOAD_MIB_PER_S) + STARTUP_FIXED_S)
    return PodSizing(
        host_tier_gib=host,
        disk_tier_gib=disk,
        volume_gib=math.ceil(disk * 1.1) + 1,
        memory_gib=host + math.ceil(weights_gib) + HOST_OVERHEAD_GIB,
        startup_failure_threshold=math.ceil(startup_s / STARTUP_PERIOD_S),
    )
