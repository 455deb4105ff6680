"""Templates that render the same content differently: requests whose first message says the same thing (up to
whitespace and volatile values) and whose tools are the same set, but whose rendered prompt text up to the end
of that message differs: whitespace in the content, tools listed in another order, or another chat template
(a second server, other chat_template_kwargs). Each variant starts a prefix of its own in the cache."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from kvserve.advise.records import PromptRecord, message_content
from kvserve.advise.rendering import Renderer
from kvserve.advise.spans import DynamicSpanFinding
from kvserve.advise.versions import version_key

WHITESPACE = "whitespace in the content"
TOOLS_ORDER = "tools in another order"
TEMPLATE = "another chat template or template arguments"
_SPACES = re.compile(r"\s+")


@dataclass(slots=True)
class RenderedHead:
    position: int
    template_prefix: str  # what the template writes before the first message's content
    content: str
    rest: str  # the rendered text after that content
    tools_order: tuple[str, ...]


@dataclass(slots=True)
class TemplateVariants:
    role: str
    excerpt: str  # the start of the content they share
    heads: list[RenderedHead]
    signatures: list[str]  # per head: its rendering with volatile values masked
    causes: list[str] = field(default_factory=list)

    @property
    def num_variants(self) -> int:
        return len(set(self.signatures))

    @property
    def canonical(self) -> str:
        return Counter(self.signatures).most_common(1)[0][0]


def rendered_head(position: int, record: PromptRecord) -> RenderedHead | None:
    if not record.messages or record.prompt_text is None:
        return None
    content = message_content(record.messages[0])
    found = record.prompt_text.find(content) if content else -1
    if found < 0:
        return None
    tools = tuple(tool_name(tool) for tool in record.body.get("tools") or [])
    return RenderedHead(position, record.prompt_text[:found], content, record.prompt_text[found + len(content):],
                        tools)


def tool_name(tool) -> str:
    return str((tool.get("function") or tool).get("name")) if isinstance(tool, dict) else str(tool)


def find_template_variants(records: list[PromptRecord], findings: list[DynamicSpanFinding]) -> list[TemplateVariants]:
    groups: dict[str, TemplateVariants] = {}
    for position, record in enumerate(records):
        head = rendered_head(position, record)
        if head is None:
            continue
        masked = version_key(head.content, findings)
        key = json.dumps([record.messages[0].get("role"), _SPACES.sub(" ", masked).strip(), sorted(head.tools_order)])
        group = groups.setdefault(key, TemplateVariants(str(record.messages[0].get("role")), masked[:60], [], []))
        group.heads.append(head)
        group.signatures.append(json.dumps([head.template_prefix, masked, head.tools_order]))
    found = [group for group in groups.values() if group.num_variants > 1]
    for group in found:
        group.causes = _causes(group, findings)
    return found


def _causes(group: TemplateVariants, findings: list[DynamicSpanFinding]) -> list[str]:
    causes = []
    if len({version_key(head.content, findings) for head in group.heads}) > 1:
        causes.append(WHITESPACE)
    if len({head.tools_order for head in group.heads}) > 1:
        causes.append(TOOLS_ORDER)
    if len({head.template_prefix for head in group.heads}) > 1 or not causes:
        causes.append(TEMPLATE)
    return causes


def canonical_token_ids(records: list[PromptRecord], group: TemplateVariants,
                        renderer: Renderer) -> tuple[dict[int, list[int]], int]:
    """Per record position: the prompt rendered the most common way (its template prefix, and its content's
    whitespace when that varies). Records already rendered that way keep their ids."""
    canonical = group.canonical
    model = group.heads[group.signatures.index(canonical)]
    rewritten: dict[int, list[int]] = {}
    for head, signature in zip(group.heads, group.signatures):
        if signature == canonical:
            continue
        record = records[head.position]
        if TOOLS_ORDER in group.causes:  # tools may render anywhere in the prompt: render it again, reordered
            order = {name: index for index, name in enumerate(model.tools_order)}
            tools = sorted(record.body["tools"], key=lambda tool: order.get(tool_name(tool), len(order)))
            rewritten[head.position] = renderer.render_chat(dict(record.body, tools=tools), record.messages or [])[1]
            continue
        content = model.content if WHITESPACE in group.causes else head.content
        rewritten[head.position] = renderer.encode_text(record, model.template_prefix + content + head.rest)
    return rewritten, len(rewritten)
