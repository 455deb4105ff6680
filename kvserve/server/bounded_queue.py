"""A thread-safe FIFO bounded both in entries and in (approximate) bytes: `put` refuses instead of growing, so a
slow consumer costs dropped items rather than the process's memory."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class BoundedQueue:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        assert max_entries >= 1 and max_bytes >= 1
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: deque[tuple[Any, int]] = deque()
        self._num_bytes = 0
        self._ready = threading.Condition()

    def put(self, item: Any, num_bytes: int) -> bool:
        """False (and nothing kept) when the item does not fit; an item alone over max_bytes fits an empty queue."""
        with self._ready:
            full = len(self._items) >= self.max_entries or (self._items and self._num_bytes + num_bytes > self.max_bytes)
            if full:
                return False
            self._items.append((item, num_bytes))
            self._num_bytes += num_bytes
            self._ready.notify()
            return True

    def put_always(self, item: Any) -> None:
        """For control items (a stop marker) that must get through whatever the bound."""
        with self._ready:
            self._items.append((item, 0))
            self._ready.notify()

    def get(self) -> Any:
        with self._ready:
            while not self._items:
                self._ready.wait()
            item, num_bytes = self._items.popleft()
            self._num_bytes -= num_bytes
            return item

    def empty(self) -> bool:
        with self._ready:
            return not self._items
