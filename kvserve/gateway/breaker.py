"""Per-backend circuit breaker: after `failure_threshold` consecutive failures (connect errors, 5xx before the
first byte) the backend is skipped for `open_s` seconds; then one trial request is let through (half-open) and
its outcome closes the breaker or opens it again. Keeps retries from hammering a dead engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's encoding


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 5
    open_s: float = 30.0
    consecutive_failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False
    clock: object = field(default=time.monotonic, repr=False)

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.clock() - self.opened_at >= self.open_s else OPEN

    def allows_request(self) -> bool:
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.trial_in_flight)

    def on_attempt(self) -> None:
        if self.state == HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.trial_in_flight = False

    def on_failure(self) -> None:
        self.consecutive_failures += 1
        self.trial_in_flight = False
        if self.state == HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.opened_at = self.clock()
