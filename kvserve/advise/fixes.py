"""The fixes whose hit rate the advisor predicts, as rewrites of the prompts' texts, re-rendered like the server.

A prompt is edited as its segments (the messages of a chat, or the one completion prompt); a fix returns new
segment texts, `render_segments` turns the edited records back into token ids with the model's chat template,
and the replay scores them. Records a fix leaves alone keep the token ids the server logged.
"""

from __future__ import annotations

import copy
import re

from kvserve.advise.records import CHAT, PromptRecord
from kvserve.advise.rendering import Renderer
from kvserve.advise.spans import (
    MIN_SHARED_AFTER_CHARS, DynamicSpanFinding, common_prefix, pattern_after, segments, sentence_bounds,
)

Texts = list[list[str]]  # per record, per segment
_BREAK_BEFORE = re.compile(r"[\s\S]*(?:[.!?]\s|\n)")


def original_texts(records: list[PromptRecord]) -> Texts:
    return [[text for _, text in segments(record)] for record in records]


def cut_span_sentence(text: str, finding: DynamicSpanFinding) -> tuple[str, str, str] | None:
    """(the text without the sentence holding the span, that sentence, the break that followed it)."""
    match = pattern_after(finding.anchor, finding.kind).search(text)
    if match is None:
        return None
    start, end = sentence_bounds(text, match.start(), match.end())
    separator = "\n" if text[end:end + 1] == "\n" else " "
    rest = text[:start] + text[end:].lstrip()
    return rest, text[start:end].strip(), separator


def move_span(records: list[PromptRecord], texts: Texts, finding: DynamicSpanFinding) -> Texts:
    """The sentence that holds the dynamic value moves after the static part: to the end of its message (chat),
    or to where the prompt stops matching its neighbour once the sentence is out (a completion prompt)."""
    cuts = [_cut(record_texts, finding) for record_texts in texts]
    edited = copy.deepcopy(texts)
    for position, (record, cut) in enumerate(zip(records, cuts)):
        if cut is None:
            continue
        rest, sentence, separator = cut
        if record.kind == CHAT:
            target = move_target(texts[position], finding, rest)
            if target == finding.segment:
                new_text = rest.rstrip() + separator + sentence
            else:
                new_text = rest.rstrip()
                edited[position][target] = texts[position][target].rstrip() + separator + sentence
        else:
            neighbour = _neighbour_rest(cuts, position)
            split = _static_end(rest, neighbour) if neighbour is not None else len(rest)
            new_text = rest[:split] + sentence + separator + rest[split:] if split < len(rest) else (
                rest.rstrip() + separator + sentence)
        edited[position][finding.segment] = new_text
    return edited


def move_target(record_texts: list[str], finding: DynamicSpanFinding, rest: str) -> int:
    """The message a dynamic sentence moves to the end of: its own, unless little is left in it (the static
    part is in the messages after it), then the last one."""
    if len(rest.strip()) < MIN_SHARED_AFTER_CHARS and finding.segment < len(record_texts) - 1:
        return len(record_texts) - 1
    return finding.segment


def remove_span(records: list[PromptRecord], texts: Texts, finding: DynamicSpanFinding) -> Texts:
    edited = copy.deepcopy(texts)
    for position, record_texts in enumerate(texts):
        cut = _cut(record_texts, finding)
        if cut is not None:
            edited[position][finding.segment] = cut[0].rstrip()
    return edited


def pin_system_prompt(records: list[PromptRecord], texts: Texts, version_of: list[int | None], pinned: int,
                      pinned_text: str) -> Texts:
    """Every record with a system prompt of another version gets the pinned version's text."""
    edited = copy.deepcopy(texts)
    for position, version in enumerate(version_of):
        if version is not None and version != pinned:
            edited[position][0] = pinned_text
    return edited


def _cut(record_texts: list[str], finding: DynamicSpanFinding) -> tuple[str, str, str] | None:
    if finding.segment >= len(record_texts):
        return None
    return cut_span_sentence(record_texts[finding.segment], finding)


def _neighbour_rest(cuts: list, position: int) -> str | None:
    for other in (position - 1, position + 1):
        if 0 <= other < len(cuts) and cuts[other] is not None:
            return cuts[other][0]
    return None


def _static_end(text: str, neighbour: str) -> int:
    """Where `text` stops matching `neighbour`, moved back to the last sentence or line break before it."""
    index = common_prefix(text, neighbour)
    head = _BREAK_BEFORE.match(text[:index])
    return head.end() if head else index


def render_segments(records: list[PromptRecord], texts: Texts, renderer: Renderer) -> tuple[list[list[int]], int]:
    """Token ids per record after an edit, and how many records changed."""
    original = original_texts(records)
    token_ids: list[list[int]] = []
    num_changed = 0
    for record, before, after in zip(records, original, texts):
        if before == after:
            token_ids.append(record.token_ids or [])
            continue
        num_changed += 1
        token_ids.append(render_edited(record, after, renderer))
    return token_ids, num_changed


def render_edited(record: PromptRecord, texts: list[str], renderer: Renderer) -> list[int]:
    if record.kind == CHAT:
        messages = [dict(message, content=text) for message, text in zip(record.messages or [], texts)]
        return renderer.render_chat(record.body, messages)[1]
    return renderer.encode_text(record, texts[0])
