"""Decodes that share their first blocks (cascade attention's groups), found per step from the block tables.

Requests that hit the same cached prefix (a long shared system prompt, every turn of one chat) hold the same pool
blocks at the start of their block tables. The CPU decode kernel reads such a group's shared blocks once a step
for all its members' queries and each member's own blocks after them, and merges the two softmax results
(FlashInfer's cascade attention; vLLM has it on GPUs only). Only whole blocks are shared, and never a member's
last block, which holds its new token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

# A group is worth its extra tasks and merge once its members skip this many token reads together.
MIN_SAVED_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """Per decode: how many leading tokens its group reads once (0: none), and its group's first member."""

    lens: list[int]
    leaders: list[int]


def find_shared_prefixes(tables: Sequence[Sequence[int]], block_size: int) -> SharedPrefixes | None:
    """Groups decodes by their first block, each group sharing the longest run of leading blocks all its members
    hold; None when no group saves MIN_SAVED_TOKENS token reads."""
    by_first_block: dict[int, list[int]] = defaultdict(list)
    for seq, table in enumerate(tables):
        by_first_block[table[0]].append(seq)
    lens, leaders = [0] * len(tables), list(range(len(tables)))
    for members in by_first_block.values():
        shared_blocks = _common_blocks([tables[m] for m in members])
        if shared_blocks * block_size * (len(members) - 1) < MIN_SAVED_TOKENS:
            continue
        for member in members:
            lens[member], leaders[member] = shared_blocks * block_size, members[0]
    return SharedPrefixes(lens, leaders) if any(lens) else None


def _common_blocks(tables: list[Sequence[int]]) -> int:
    """Leading blocks every table holds, short of each table's last block."""
    first = tables[0]
    common = min(len(table) for table in tables) - 1
    for table in tables[1:]:
        same = 0
        while same < common and table[same] == first[same]:
            same += 1
        common = same
    return common
