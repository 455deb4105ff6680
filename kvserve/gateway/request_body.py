"""A completion request's body as the gateway reads it: capped before it is read (413, like the server), then the
fields the gateway itself acts on validated with the backend's own pydantic types, so the two never disagree
on a body. `"stream": "false"` is not a stream to either (pydantic's bool); `"stream": "x"`, `"messages": 5` or
`"stream_options": "x"` are a 400 in the envelope here, never a 500 or a backend marked failed. Every other field
passes through untouched for the backend (kvserve's or vLLM's) to judge."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from kvserve.server.body import parse_json, read_body
from kvserve.server.errors import bad_request, validation_message
from kvserve.server.protocol import ChatMessage, CompletionRequest, StreamOptions


class _GatewayFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=0)
    cache_salt: str | None = Field(None, min_length=1)
    user: str | None = None


class ChatFields(_GatewayFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)


class CompletionFields(_GatewayFields):
    prompt: CompletionRequest.model_fields["prompt"].annotation  # type: ignore[valid-type]


async def read_completion_body(request: Request, max_bytes: int, chat: bool) -> tuple[bytes, dict, _GatewayFields]:
    """(the raw bytes, the body as a dict, its checked fields); 413 past `max_bytes`, 400 for a bad body."""
    raw = await read_body(request, max_bytes)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return raw, body, checked_fields(body, chat)


def checked_fields(body: dict[str, Any], chat: bool) -> _GatewayFields:
    model = ChatFields if chat else CompletionFields
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise bad_request(message, param=param) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def upstream_content(raw: bytes, body: dict, rewritten: bool, cache_salt: str | None) -> bytes:
    """The bytes to send: the client's own unless the gateway changed the body (`rewritten`) or sets a salt. A salt
    on a body otherwise as it came is added to its bytes: a second serialization costs every request more."""
    if cache_salt is not None and (rewritten or "cache_salt" in body):
        body["cache_salt"] = cache_salt
        rewritten = True
    if rewritten:
        return json.dumps(body, ensure_ascii=False).encode()
    if cache_salt is None:
        return raw
    end = raw.rindex(b"}")  # a JSON object with fields (messages or prompt are required): add one before it
    return raw[:end] + b',"cache_salt":' + json.dumps(cache_salt).encode() + raw[end:]
