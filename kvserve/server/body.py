"""Reading a request body: size limit, JSON, Unicode, then the pydantic model, each failure a 4xx envelope.

Done by hand rather than through FastAPI's body parameters so every failure has its own message and status
(413 for an oversized body, 400 for the rest) and nothing the client sends can surface as a 5xx.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.server.errors import APIError, bad_request, validation_message

ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(request: Request, model: type[ModelT], max_bytes: int) -> ModelT:
    data = parse_json(await read_body(request, max_bytes))
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        bad_path = find_unencodable_string(data)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if bad_path is not None:
        raise bad_request(f"{bad_path or 'a key'} is not valid Unicode (it holds a lone surrogate)", param=bad_path)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        raise bad_request(message, param=param) from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_bytes} bytes (--max-request-bytes)", code="request_too_large")


def parse_json(body: bytes) -> Any:
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, int too long, nesting too deep
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def find_unencodable_string(value: Any, path: str = "") -> str | None:
    """Path of the first string (or key) that UTF-8 cannot encode, e.g. a lone surrogate from "\\ud800"."""
    if isinstance(value, str):
        return None if _encodable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if not _encodable(key):
                return path
            found = find_unencodable_string(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_unencodable_string(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
