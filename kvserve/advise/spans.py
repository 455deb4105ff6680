"""Dynamic content near the head of prompts: where consecutive, mostly equal prompts first differ, and what the
differing text is (a timestamp, a date, a UUID, a hex id, a number, or a varying word such as a user's name).

Two prompts that differ in a short span and agree again after it are the signature: everything after the span
is shared text the cache cannot reuse, because a block hash covers the whole prefix before it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from statistics import median

from kvserve.advise.records import PromptRecord, message_content

# Most specific first: a timestamp also contains a date, a time and numbers.
SPAN_PATTERNS: dict[str, str] = {
    "timestamp": r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2}| ?UTC)?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "date": r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}|(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? "
            r"\d{1,2}(?:st|nd|rd|th)?,? \d{4}",
    "time": r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?: ?[AaPp][Mm])?",
    "hex id": r"(?<![0-9A-Za-z])(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{6,}(?![0-9A-Za-z])",
    "number": r"\d+(?:[.,]\d+)*",
}
VARYING_WORD = "varying word"
_COMPILED = {kind: re.compile(pattern) for kind, pattern in SPAN_PATTERNS.items()}
_WORD = re.compile(r"[\w'-]+")
# Kinds masked when grouping system prompts into versions: never part of a deliberate edit.
VOLATILE_KINDS = ("timestamp", "uuid", "date", "time", "hex id")

MIN_SHARED_AFTER_CHARS = 48  # re-converging on less than this is not worth a finding
MAX_SPAN_CHARS = 120  # a longer difference is different content, not a dynamic value
MAX_ANCHOR_CHARS = 40
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclass(slots=True)
class SpanSighting:
    """One span seen between a record and the one before it."""

    record_index: int  # position in the records list
    segment: int  # message index (chat) or 0 (a completion prompt)
    role: str
    kind: str
    value: str
    char_offset: int  # in the segment's text
    token_offset: int  # the first token where the two prompts differ
    anchor: str  # the static text before the span, in its sentence


@dataclass(slots=True)
class DynamicSpanFinding:
    segment: int
    role: str
    kind: str
    anchor: str
    sightings: list[SpanSighting] = field(default_factory=list)

    @property
    def token_offset(self) -> int:
        return int(median(s.token_offset for s in self.sightings))

    @property
    def char_offset(self) -> int:
        return int(median(s.char_offset for s in self.sightings))

    @property
    def examples(self) -> list[str]:
        return [value for value, _ in Counter(s.value for s in self.sightings).most_common(3)]


def segments(record: PromptRecord) -> list[tuple[str, str]]:
    """(role, text) of each part a span can sit in: the messages of a chat, or the one completion prompt."""
    if record.messages is not None:
        return [(str(message.get("role")), message_content(message)) for message in record.messages]
    text = record.prompt if isinstance(record.prompt, str) else (record.prompt_text or "")
    return [("prompt", text)]


def find_dynamic_spans(records: list[PromptRecord], min_sightings: int = 2) -> list[DynamicSpanFinding]:
    findings: dict[tuple, DynamicSpanFinding] = {}
    for position in range(1, len(records)):
        for sighting in compare_records(records[position - 1], records[position], position):
            key = (sighting.segment, sighting.role, sighting.kind, sighting.anchor)
            finding = findings.setdefault(key, DynamicSpanFinding(*key))
            finding.sightings.append(sighting)
    kept = [finding for finding in findings.values() if len(finding.sightings) >= min_sightings]
    return sorted(kept, key=lambda finding: (finding.token_offset, -len(finding.sightings)))


def compare_records(previous: PromptRecord, current: PromptRecord, position: int) -> list[SpanSighting]:
    """The dynamic spans in the first part where two prompts differ, if they agree again after it."""
    before, after = segments(previous), segments(current)
    for segment, ((role_a, text_a), (role_b, text_b)) in enumerate(zip(before, after)):
        if role_a != role_b:
            return []
        if text_a == text_b:
            continue
        region = differing_region(text_a, text_b, before[segment + 1:], after[segment + 1:])
        if region is None:
            return []  # the usual unique tail (a user's question), not dynamic content
        token_offset = common_prefix(previous.token_ids or [], current.token_ids or [])
        return [SpanSighting(position, segment, role_b, kind, text_b[start:end], start, token_offset,
                             anchor_before(text_b, start))
                for kind, start, end in differing_spans(text_b, *region)]
    return []


def differing_region(text_a: str, text_b: str, later_a: list, later_b: list) -> tuple[str, str, int] | None:
    """(the differing text of a, of b, where it starts) when the texts agree again on MIN_SHARED_AFTER_CHARS
    within MAX_SPAN_CHARS of their first difference: inside the part, or at its end and on into the next parts."""
    start = common_prefix(text_a, text_b)
    window_a = text_a[start:start + MAX_SPAN_CHARS + MIN_SHARED_AFTER_CHARS]
    for skip_b in range(MAX_SPAN_CHARS + 1):
        probe = text_b[start + skip_b:start + skip_b + MIN_SHARED_AFTER_CHARS]
        if len(probe) < MIN_SHARED_AFTER_CHARS:
            break
        skip_a = window_a.find(probe)
        if skip_a >= 0:
            return text_a[start:start + skip_a], text_b[start:start + skip_b], start
    suffix = min(common_suffix(text_a, text_b), len(text_a) - start, len(text_b) - start)
    shared_later = 0  # what the next parts share: whole equal parts, then the head of the first that differs
    for (_, later_text_a), (_, later_text_b) in zip(later_a, later_b):
        if later_text_a != later_text_b:
            shared_later += common_prefix(later_text_a, later_text_b)
            break
        shared_later += len(later_text_b)
    middle_a, middle_b = text_a[start:len(text_a) - suffix], text_b[start:len(text_b) - suffix]
    if suffix + shared_later < MIN_SHARED_AFTER_CHARS or max(len(middle_a), len(middle_b)) > MAX_SPAN_CHARS:
        return None
    return middle_a, middle_b, start


def differing_spans(text_b: str, middle_a: str, middle_b: str, start: int) -> list[tuple[str, int, int]]:
    """(kind, start, end) in text_b of each run where the middles differ, widened to the value it is in."""
    matcher = SequenceMatcher(None, middle_a, middle_b, autojunk=False)
    spans: list[tuple[str, int, int]] = []
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        span = classify(text_b, start + j1, start + j2)
        if spans and span[1] < spans[-1][2]:  # overlaps the previous one: the same value
            kind, first, last = spans.pop()
            span = (kind, first, max(last, span[2]))
        spans.append(span)
    return spans


def classify(text: str, start: int, end: int) -> tuple[str, int, int]:
    """The most specific value around text[start:end]: a pattern match overlapping it, else the words it spans."""
    probe_end = max(end, start + 1)
    for kind, pattern in _COMPILED.items():
        for match in pattern.finditer(text, max(0, start - 64), min(len(text), probe_end + 64)):
            if match.start() < probe_end and match.end() > start:
                return kind, min(match.start(), start), max(match.end(), end)
    word_start, word_end = start, end
    while word_start > 0 and _WORD.match(text[word_start - 1]):
        word_start -= 1
    while word_end < len(text) and _WORD.match(text[word_end]):
        word_end += 1
    return VARYING_WORD, word_start, word_end


def anchor_before(text: str, start: int) -> str:
    """The static text before a span, from the start of its sentence (at most MAX_ANCHOR_CHARS)."""
    sentence_start = sentence_bounds(text, start, start)[0]
    return text[max(sentence_start, start - MAX_ANCHOR_CHARS):start]


def sentence_bounds(text: str, start: int, end: int) -> tuple[int, int]:
    """The sentence (or line) that holds text[start:end]: from after the previous break to its own end."""
    sentence_start = 0
    for match in _SENTENCE_BREAK.finditer(text, 0, start):
        sentence_start = match.end()
    following = _SENTENCE_BREAK.search(text, end)
    return sentence_start, following.start() if following else len(text)


def mask_volatile(text: str) -> str:
    """The text with timestamps, dates, times, UUIDs and hex ids replaced by their kind, for grouping."""
    for kind in VOLATILE_KINDS:
        text = _COMPILED[kind].sub(f"<{kind}>", text)
    return text


def pattern_after(anchor: str, kind: str) -> re.Pattern:
    """Finds this finding's span in any record: the anchor, then a value of the kind."""
    value = SPAN_PATTERNS.get(kind, r"[\w'-]+" if kind == VARYING_WORD else r"[^\n]+?")
    return re.compile(re.escape(anchor) + f"(?:{value})")


def common_prefix(a, b) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def common_suffix(a, b) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[-1 - index] == b[-1 - index]:
        index += 1
    return index
