"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), for placing NEW sessions.

Each backend owns `virtual_nodes` points on a 64-bit ring; a session goes to the first backend clockwise of its
hash whose share is not full, a share being ceil(load_factor x (sessions + 1) / backends). So a session's
backend depends only on the backend set and on how full each is, never on which gateway replica asks, and
adding or losing a backend moves only the sessions it owned.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator


def ring_hash(text: str) -> int:
    # blake2b rather than hash(): the same on every replica, run and Python version.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: list[str], virtual_nodes: int = 64) -> None:
        assert nodes, "a ring needs at least one node"
        points = sorted((ring_hash(f"{node}#{i}"), node) for node in nodes for i in range(virtual_nodes))
        self.point_hashes = [h for h, _ in points]
        self.point_nodes = [n for _, n in points]
        self.nodes = list(dict.fromkeys(nodes))

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, in ring order starting at the owner of `key`."""
        start = bisect.bisect(self.point_hashes, ring_hash(key))
        seen: set[str] = set()
        for offset in range(len(self.point_nodes)):
            node = self.point_nodes[(start + offset) % len(self.point_nodes)]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return

    def owner(self, key: str) -> str:
        return next(self.walk(key))


def share_capacity(session_counts: dict[str, int], eligible: list[str], load_factor: float) -> int:
    """The most sessions one eligible backend may hold once one more session is placed."""
    total = sum(session_counts.get(node, 0) for node in eligible) + 1
    return math.ceil(load_factor * total / len(eligible))


def bounded_owner(ring: HashRing, key: str, session_counts: dict[str, int], eligible: list[str],
                  load_factor: float) -> str:
    """The first eligible backend clockwise of `key` that is under its share. One always exists: the shares sum
    to at least the sessions placed plus one, so some eligible backend is below its share."""
    assert eligible and load_factor >= 1.0
    capacity = share_capacity(session_counts, eligible, load_factor)
    allowed = set(eligible)
    for node in ring.walk(key):
        if node in allowed and session_counts.get(node, 0) < capacity:
            return node
    raise AssertionError("no eligible backend under its share")  # unreachable, see the docstring
