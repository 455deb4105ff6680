"""Open-loop arrival times: a Poisson process, or a gamma process for burstier or smoother traffic.

As vLLM's `--burstiness`: intervals are gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean rate
is `rate` whatever the burstiness; 1 is Poisson (exponential intervals), < 1 burstier, > 1 more regular.
Arrivals are scheduled against absolute times, so the event loop's lateness on one does not shift the rest.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np


def arrival_intervals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    assert rate > 0 and burstiness > 0
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    while True:
        yield float(rng.gamma(burstiness, scale))


async def arrivals(rate: float, burstiness: float, seed: int) -> AsyncIterator[float]:
    """Yields at each arrival (the first at once) its scheduled time in perf_counter seconds; never ends."""
    due = time.perf_counter()
    for interval in arrival_intervals(rate, burstiness, seed):
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield due
        due += interval
