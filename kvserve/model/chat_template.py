"""Chat templates rendered with jinja2 the way transformers renders them.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls), same helpers (`raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII), same variables (messages, add_generation_prompt, tools,
documents and the special tokens), so a template written for transformers renders the same string here.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error: {exc}") from None


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str | None] | None = None,
    **extra: Any,
) -> str:
    template = compile_template(source)
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **(special_tokens or {}),
            **extra,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from None


def select_template(templates: str | list[dict[str, str]] | dict[str, str] | None, use_tools: bool) -> str | None:
    """tokenizer_config.json may hold one template or several named ones ('default', 'tool_use', ...)."""
    if templates is None or isinstance(templates, str):
        return templates
    named = templates if isinstance(templates, dict) else {t["name"]: t["template"] for t in templates}
    if use_tools and "tool_use" in named:
        return named["tool_use"]
    return named.get("default") or next(iter(named.values()), None)
