"""One advisor run: replay the log as it is, find what breaks prefixes, and replay each fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.advise.fixes import (
    Texts, cut_span_sentence, move_span, move_target, original_texts, pin_system_prompt, remove_span,
    render_segments,
)
from kvserve.advise.records import LoadedLog, PoolShape, PromptRecord
from kvserve.advise.rendering import Renderer
from kvserve.advise.replay import ReplayResult, hit_rate, replay
from kvserve.advise.spans import DynamicSpanFinding, find_dynamic_spans
from kvserve.advise.templates import TemplateVariants, canonical_token_ids, find_template_variants
from kvserve.advise.versions import Versions, find_versions


@dataclass(slots=True)
class FixPrediction:
    finding: str  # "span 1", "versions", "template 1", "all"
    action: str  # what to change, in words
    replayed: ReplayResult  # the log replayed with the fix
    num_changed: int  # requests the fix rewrote

    @property
    def hit_rate(self) -> float:
        return self.replayed.hit_rate


@dataclass(slots=True)
class Analysis:
    records: list[PromptRecord]
    pool: PoolShape
    logged_hit_rate: float | None  # from the engine's cached tokens; None for request bodies
    replayed: ReplayResult  # the log as it is
    spans: list[DynamicSpanFinding]
    versions: Versions
    variants: list[TemplateVariants]
    fixes: list[FixPrediction] = field(default_factory=list)

    @property
    def hits_and_queries(self) -> tuple[list[int], list[int]]:
        return hits_and_queries(self.records, self.logged_hit_rate, self.replayed)


def hits_and_queries(records: list[PromptRecord], logged_hit_rate: float | None,
                     replayed: ReplayResult) -> tuple[list[int], list[int]]:
    """Per record, (cached, prompt) tokens as the log has them (usage counts a prompt once), else the replay's."""
    if logged_hit_rate is None:
        return replayed.hit_tokens, replayed.prompt_tokens
    return [record.cached_tokens or 0 for record in records], [len(record.token_ids or []) for record in records]


def analyse(log: LoadedLog, renderer: Renderer, min_sightings: int = 2) -> Analysis:
    records, pool = log.records, log.pool
    replayed = replay(records, pool)
    logged = _logged_hit_rate(records) if log.from_server_log else None
    spans = find_dynamic_spans(records, min_sightings)
    texts = original_texts(records)
    versions = find_versions(records, texts, *hits_and_queries(records, logged, replayed), spans)
    variants = find_template_variants(records, spans)
    analysis = Analysis(records, pool, logged, replayed, spans, versions, variants)
    analysis.fixes = predict_fixes(analysis, texts, renderer)
    return analysis


def move_action(records: list[PromptRecord], texts: Texts, span: DynamicSpanFinding) -> str:
    sentence = f"the sentence with the {span.kind}" + (f" ({span.anchor.strip()!r} ...)" if span.anchor.strip() else "")
    if span.role == "prompt":
        return f"move {sentence} after the prompt's static part"
    position = span.sightings[0].record_index
    cut = cut_span_sentence(texts[position][span.segment], span)
    target = span.segment if cut is None else move_target(texts[position], span, cut[0])
    role = records[position].messages[target].get("role") if records[position].messages else span.role
    return f"move {sentence} to the end of message {target} ({role}), after the static part"


def _logged_hit_rate(records: list[PromptRecord]) -> float | None:
    known = [record for record in records if record.cached_tokens is not None]
    if not known:
        return None
    return hit_rate(sum(r.cached_tokens for r in known), sum(len(r.token_ids or []) for r in known))


def predict_fixes(analysis: Analysis, texts: Texts, renderer: Renderer) -> list[FixPrediction]:
    records, pool = analysis.records, analysis.pool
    fixes: list[FixPrediction] = []
    combined = texts

    def add(finding: str, action: str, token_ids: list[list[int]], num_changed: int) -> None:
        fixes.append(FixPrediction(finding, action, replay(records, pool, token_ids), num_changed))

    def add_edit(finding: str, action: str, edited: Texts) -> None:
        add(finding, action, *render_segments(records, edited, renderer))

    for number, span in enumerate(analysis.spans, start=1):
        add_edit(f"span {number}", move_action(records, texts, span), move_span(records, texts, span))
        add_edit(f"span {number}", f"remove the sentence with the {span.kind}", remove_span(records, texts, span))
        combined = move_span(records, combined, span)
    versions = analysis.versions
    if len(versions.versions) > 1:
        pinned = max(versions.versions, key=lambda version: len(version.positions))
        add_edit("versions", f"pin system prompt v{pinned.number}",
                 pin_system_prompt(records, texts, versions.version_of, pinned.number, pinned.text))
        # In the combination the pinned text is the pinned version's own request with its spans moved too.
        combined = pin_system_prompt(records, combined, versions.version_of, pinned.number,
                                     combined[pinned.positions[0]][0])
    for number, group in enumerate(analysis.variants, start=1):
        rewritten, num_changed = canonical_token_ids(records, group, renderer)
        add(f"template {number}", "render it one way (the most common)",
            [rewritten.get(position, record.token_ids or []) for position, record in enumerate(records)], num_changed)
    if len(fixes) > 2 and combined is not texts:
        add_edit("all", "every span moved" + (" and one system prompt pinned" if len(versions.versions) > 1 else ""),
                 combined)
    return fixes
