"""Response bodies in OpenAI's shapes (plain dicts: they are built once per chunk on the hot path).

Completion:        {"id": "cmpl-..", "object": "text_completion", "created", "model", "choices": [{"index", "text",
                    "logprobs", "finish_reason", "stop_reason"}], "usage"}
Chat completion:   {"id": "chatcmpl-..", "object": "chat.completion", "created", "model", "system_fingerprint",
                    "choices": [{"index", "message": {"role", "content", "refusal"}, "logprobs", "finish_reason",
                    "stop_reason"}], "usage"}
Chat chunk:        same with "object": "chat.completion.chunk" and "delta" instead of "message".
Usage:             {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens",
                   and kvserve's "computed_tokens" and, when the KV tiers loaded any, "tier_loaded_tokens"}}
`stop_reason` is vLLM's addition: the stop string or stop token id that ended the choice (null for EOS / length).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from starlette.responses import Response


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_unix() -> int:
    return int(time.time())


def json_response(body: dict, status_code: int = 200) -> Response:
    return Response(dumps(body), status_code=status_code, media_type="application/json")


def dumps(body: dict) -> str:
    # allow_nan=False: a NaN that slipped through must fail loudly here, not produce invalid JSON for the client.
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@dataclass(slots=True)
class UsageCounter:
    """Token counts of one API request, summed over its prompts and choices."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    completion_by_choice: dict[int, int] = field(default_factory=dict)
    tier_loaded_tokens: dict[str, int] = field(default_factory=dict)  # of cached_tokens, per KV tier

    def add_prompt(self, num_prompt_tokens: int, num_cached_tokens: int,
                   tier_loaded_tokens: dict[str, int] | None = None) -> None:
        self.prompt_tokens += num_prompt_tokens
        self.cached_tokens += num_cached_tokens
        for tier, tokens in (tier_loaded_tokens or {}).items():
            self.tier_loaded_tokens[tier] = self.tier_loaded_tokens.get(tier, 0) + tokens

    def set_choice_tokens(self, choice_index: int, num_tokens: int) -> None:
        self.completion_tokens += num_tokens - self.completion_by_choice.get(choice_index, 0)
        self.completion_by_choice[choice_index] = num_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": self._prompt_details(),
        }

    def _prompt_details(self) -> dict:
        """OpenAI's cached_tokens (every tier counts), plus kvserve's split: what the KV tiers loaded back into
        the pool (per tier) and what was computed."""
        details = {"cached_tokens": self.cached_tokens, "computed_tokens": self.prompt_tokens - self.cached_tokens}
        if self.tier_loaded_tokens:
            details["tier_loaded_tokens"] = dict(self.tier_loaded_tokens)
        return details


def completion_body(response_id: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_body(response_id: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage}


def chat_chunk_body(response_id: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage}


def chat_choice(index: int, content: str, logprobs: dict | None, finish_reason: str | None,
                stop_reason: int | str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": content, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}
