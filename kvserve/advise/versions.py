"""System-prompt versions: the distinct system prompts (or, for completion prompts, the text before the first
blank line), with their volatile values masked so a timestamp does not make every request a version of its own;
when each was seen, how often, its hit rate, and the hit rate just before and after each change."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.advise.records import PromptRecord
from kvserve.advise.replay import hit_rate
from kvserve.advise.spans import DynamicSpanFinding, common_prefix, mask_volatile, pattern_after

CHANGE_WINDOW = 4  # requests before and after a change whose hit rates are compared: the first ones show the drop
MAX_HEAD_CHARS = 4000


@dataclass(slots=True)
class PromptVersion:
    number: int  # 1, 2, ... in order of first appearance
    text: str  # the first request's text of this version
    positions: list[int] = field(default_factory=list)
    first_time: float | None = None
    last_time: float | None = None
    hits: int = 0
    queries: int = 0

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.queries)


@dataclass(slots=True)
class VersionChange:
    position: int  # the first request of the new version
    time: float | None
    old: int
    new: int
    hit_rate_before: float
    hit_rate_after: float
    char_offset: int  # where the two texts first differ
    token_offset: int  # where the prompts on either side of the change first differ: the cache breaks there
    old_excerpt: str
    new_excerpt: str


@dataclass(slots=True)
class Versions:
    versions: list[PromptVersion]
    version_of: list[int | None]  # per record: its version number, None without a system prompt
    changes: list[VersionChange]


def head_text(record: PromptRecord, texts: list[str]) -> str | None:
    """The part that names a version: the system message, or a completion prompt's first paragraph."""
    if record.messages is not None:
        return texts[0] if record.system_text is not None else None
    paragraph_end = texts[0].find("\n\n")
    return texts[0][:paragraph_end] if 0 < paragraph_end <= MAX_HEAD_CHARS else None


def version_key(text: str, findings: list[DynamicSpanFinding]) -> str:
    for finding in findings:
        if finding.segment == 0:
            text = pattern_after(finding.anchor, finding.kind).sub(f"{finding.anchor}<{finding.kind}>", text)
    return mask_volatile(text)


def find_versions(records: list[PromptRecord], texts: list[list[str]], hits: list[int], queries: list[int],
                  findings: list[DynamicSpanFinding]) -> Versions:
    by_key: dict[str, PromptVersion] = {}
    version_of: list[int | None] = []
    for position, record in enumerate(records):
        head = head_text(record, texts[position])
        if head is None:
            version_of.append(None)
            continue
        key = version_key(head, findings)
        version = by_key.get(key)
        if version is None:
            version = by_key[key] = PromptVersion(len(by_key) + 1, head, first_time=record.time)
        version.positions.append(position)
        version.last_time = record.time
        version.hits += hits[position]
        version.queries += queries[position]
        version_of.append(version.number)
    versions = list(by_key.values())
    return Versions(versions, version_of, _changes(records, versions, version_of, hits, queries))


def _changes(records: list[PromptRecord], versions: list[PromptVersion], version_of: list[int | None],
             hits: list[int], queries: list[int]) -> list[VersionChange]:
    changes = []
    previous: tuple[int, int] | None = None  # (position, version) of the last record with a version
    for position, version in enumerate(version_of):
        if version is None:
            continue
        if previous is not None and previous[1] != version:
            old, new = versions[previous[1] - 1], versions[version - 1]
            before = [p for p in range(position) if version_of[p] is not None][-CHANGE_WINDOW:]
            after = [p for p in range(position, len(version_of)) if version_of[p] is not None][:CHANGE_WINDOW]
            offset, old_excerpt, new_excerpt = first_difference(old.text, new.text)
            token_offset = common_prefix(records[previous[0]].token_ids or [], records[position].token_ids or [])
            changes.append(VersionChange(
                position, records[position].time, old.number, new.number,
                hit_rate(sum(hits[p] for p in before), sum(queries[p] for p in before)),
                hit_rate(sum(hits[p] for p in after), sum(queries[p] for p in after)),
                offset, token_offset, old_excerpt, new_excerpt))
        previous = (position, version)
    return changes


def first_difference(old: str, new: str, context: int = 30) -> tuple[int, str, str]:
    offset = common_prefix(old, new)
    start = max(0, offset - 10)
    return offset, old[start:offset + context], new[start:offset + context]
