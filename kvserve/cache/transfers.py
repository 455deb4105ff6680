"""Block copies between the pool and the KV tiers as orders: the cache manager decides them while it does its
bookkeeping (an allocation that evicts cached blocks, an admission that finds blocks in a tier), and whoever runs
the step does them, in order, before the forward writes any block (KVTiers.apply). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

OFFLOAD, LOAD = "offload", "load"


@dataclass(slots=True)
class Transfer:
    """One ordered copy: offload (`items` are the blocks' hashes: copy them out to the tiers) or load (`items`
    are where each block's payload comes from: a payload a tier returned, or a FromOffload)."""

    kind: str
    block_ids: list[int]
    items: list
    # offload only: the indexes of blocks a later load of the same step takes, and their payloads once read
    kept: set[int] = field(default_factory=set)
    payloads: dict[int, object] = field(default_factory=dict)


@dataclass(slots=True)
class FromOffload:
    """A load's source that is a block evicted earlier in the same step: the tiers do not hold it until its
    offload is done, so the load takes the payload that offload read."""

    order: Transfer
    index: int
