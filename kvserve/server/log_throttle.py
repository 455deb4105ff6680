"""Warnings that repeat under a fault (every dropped or failed log line) are logged at most once per interval,
each carrying the running count, so a bad disk cannot flood the server's own log."""

from __future__ import annotations

import logging
import time


class ThrottledWarning:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last_warned = -float("inf")

    def warn(self, message: str, *args, exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        if now - self._last_warned < self.interval_s:
            return
        self._last_warned = now
        self.logger.warning(message, *args, exc_info=exc_info)
