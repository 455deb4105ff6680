"""Reading the input of `kvserve advise`: a `--log-requests-file` JSONL, or plain OpenAI request bodies.

Each engine prompt becomes one PromptRecord (a completions request with a list of prompts is several). Server
logs carry the exact token ids the engine hashed and the cached tokens it reported; request bodies carry neither,
so they are rendered and tokenized later (rendering.py) and have no logged hit rate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT = "chat"
COMPLETIONS = "completions"


class AdviseError(Exception):
    """A problem with the input that ends the run with one line on stderr."""


@dataclass(slots=True)
class PoolShape:
    """The engine's pool as the replay models it."""

    block_size: int = 16
    num_blocks: int | None = None  # None: unknown (request bodies without --num-blocks): no eviction
    hash_algo: str = "xxh3_128"
    model_path: str | None = None


@dataclass(slots=True)
class PromptRecord:
    index: int  # position in the log, the replay order
    time: float | None  # unix seconds; None for request bodies without a timestamp
    request_id: str
    kind: str  # CHAT or COMPLETIONS
    body: dict[str, Any]  # the request as sent
    messages: list[dict[str, Any]] | None  # chat: the messages as sent
    prompt: str | list[int] | None  # completions: this record's prompt as sent
    prompt_text: str | None  # the rendered prompt (chat template applied); None until rendered
    token_ids: list[int] | None  # what the engine hashed; None until tokenized
    cache_salt: str | None
    output_token_ids: list[list[int]] = field(default_factory=list)  # per choice, as generated
    cached_tokens: int | None = None  # as the engine reported it; None for request bodies

    @property
    def system_text(self) -> str | None:
        """The system prompt: the first message when it is a system (or developer) message."""
        if not self.messages:
            return None
        first = self.messages[0]
        if first.get("role") not in ("system", "developer"):
            return None
        return message_content(first)


@dataclass(slots=True)
class LoadedLog:
    records: list[PromptRecord]
    pool: PoolShape
    from_server_log: bool  # token ids and cached tokens as the server logged them
    num_bad_lines: int
    first_bad_line: str | None  # "line 3: ..." for the warning


def message_content(message: dict[str, Any]) -> str:
    """A message's text, content parts joined as the server joins them."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content if isinstance(part, dict))


def read_log(path: Path) -> LoadedLog:
    if not path.exists():
        raise AdviseError(f"{path}: no such file")
    if not path.is_file():
        raise AdviseError(f"{path}: not a file")
    records: list[PromptRecord] = []
    pool: PoolShape | None = None
    kinds: set[bool] = set()
    num_bad, first_bad = 0, None
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                is_server_line = _is_server_line(entry)
                new_records = _server_records(entry, len(records)) if is_server_line else _body_records(
                    entry, len(records), line_number)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                num_bad += 1
                first_bad = first_bad or f"line {line_number}: {_reason(exc)}"
                continue
            kinds.add(is_server_line)
            if is_server_line and pool is None:
                pool = _pool_shape(entry.get("cache") or {})
            records.extend(new_records)
    if not records:
        detail = f" ({num_bad} malformed lines; {first_bad})" if num_bad else ""
        raise AdviseError(f"{path}: no requests in it{detail}")
    if len(kinds) > 1:
        raise AdviseError(f"{path} mixes server log lines and request bodies; give one kind per file")
    return LoadedLog(records, pool or PoolShape(), kinds == {True}, num_bad, first_bad)


def _reason(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg})"
    return str(exc) or type(exc).__name__


def _is_server_line(entry: Any) -> bool:
    if not isinstance(entry, dict):
        raise ValueError("not a JSON object")
    return "prompts" in entry and "request" in entry


def _pool_shape(cache: dict[str, Any]) -> PoolShape:
    return PoolShape(int(cache.get("block_size", 16)), cache.get("num_blocks"), cache.get("hash_algo", "xxh3_128"),
                     cache.get("model_path"))


def _server_records(entry: dict[str, Any], first_index: int) -> list[PromptRecord]:
    body = entry["request"]
    kind = CHAT if "chat" in entry["endpoint"] else COMPLETIONS
    raw_prompts = _split_prompts(body.get("prompt")) if kind == COMPLETIONS else [None]
    records = []
    for offset, logged in enumerate(entry["prompts"]):
        token_ids = logged["token_ids"]
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise ValueError("prompts[].token_ids must be a list of token ids")
        records.append(PromptRecord(
            index=first_index + offset, time=float(entry["time"]), request_id=str(entry["request_id"]), kind=kind,
            body=body, messages=body.get("messages") if kind == CHAT else None,
            prompt=raw_prompts[offset] if offset < len(raw_prompts) else None,
            prompt_text=logged.get("text"), token_ids=token_ids, cache_salt=entry.get("cache_salt"),
            output_token_ids=[list(ids) for ids in logged.get("output_token_ids") or []],
            cached_tokens=logged.get("cached_tokens"),
        ))
    return records


def _body_records(body: dict[str, Any], first_index: int, line_number: int) -> list[PromptRecord]:
    """An OpenAI chat or completions request body (optionally with a unix "time" or "created" field)."""
    when = body.get("time", body.get("created"))
    when = float(when) if isinstance(when, int | float) else None
    salt = body.get("cache_salt")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of objects")
        return [PromptRecord(first_index, when, f"line-{line_number}", CHAT, body, messages, None, None, None, salt)]
    if "prompt" in body:
        prompts = _split_prompts(body["prompt"])
        return [PromptRecord(first_index + offset, when, f"line-{line_number}", COMPLETIONS, body, None, prompt,
                             prompt if isinstance(prompt, str) else None, None if isinstance(prompt, str) else prompt,
                             salt)
                for offset, prompt in enumerate(prompts)]
    raise ValueError("neither a server log line nor a request body (no messages, no prompt)")


def _split_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return list(prompt)
    raise ValueError("prompt must be a string, a list of token ids, or a list of either")
