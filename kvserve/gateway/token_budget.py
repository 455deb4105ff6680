"""What a request may cost a key's tokens/min budget, known before it is sent: its prompt estimated from the
body plus the completion tokens it may ask for. The gateway has no tokenizer (a backend may serve any model), so
the prompt is counted in UTF-8 bytes plus a chat template's tokens per message: a byte-level BPE tokenizer
(Llama 3, Qwen2, GPT-2's) never makes more tokens than bytes, so the reservation is an upper bound and a burst
can never be admitted past the limit; the usage the backend reports settles it afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass

TEMPLATE_TOKENS_PER_MESSAGE = 8  # <|im_start|>, role, newlines, <|im_end|>: what a chat template wraps around one
TEMPLATE_TOKENS_PER_PROMPT = 16  # BOS, the generation prompt
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
# Chat fields a template renders into the prompt beside the messages (vLLM renders tools and documents; a template
# may print what chat_template_kwargs gives it): counted too, or a small message with a huge tool list would be
# admitted for the size of its message.
RENDERED_CHAT_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs")


@dataclass(slots=True)
class TokenCost:
    """A request's claim on the budget: `prompt_tokens` (estimated) plus `completion_tokens`, or, when the
    request names no limit (a chat without max_tokens may run to the model's context), all the window has left."""

    prompt_tokens: int
    completion_tokens: int | None  # None: the rest of the window's budget

    @property
    def wanted(self) -> int:
        """The least this request needs to be admitted."""
        return self.prompt_tokens + (self.completion_tokens if self.completion_tokens is not None else 1)


@dataclass(slots=True)
class TokenReservation:
    """What admission took from a window's counter, to be settled once the answer shows what was used."""

    counter: str
    reserved: int
    prompt_tokens: int  # the estimate: what a stream cut short is charged for its prompt
    open_ended: bool = False  # it took all the window had left (no max_tokens): its prompt must fit in that


def request_cost(body: dict, chat: bool) -> TokenCost:
    choices = _int_or(body.get("n"), 1) * _num_prompts(body, chat)
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens if isinstance(max_tokens, int) else body.get("max_tokens")
    if not isinstance(max_tokens, int):
        max_tokens = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    prompt = estimated_chat_prompt_tokens(body) if chat else estimated_prompt_tokens(body.get("prompt"))
    return TokenCost(prompt, None if max_tokens is None else max_tokens * choices)


def estimated_chat_prompt_tokens(body: dict) -> int:
    return estimated_chat_tokens(body.get("messages")) + sum(
        _utf8_bytes(body[name]) for name in RENDERED_CHAT_FIELDS if body.get(name))


def estimated_chat_tokens(messages: object) -> int:
    if not isinstance(messages, list):
        return TEMPLATE_TOKENS_PER_PROMPT
    return TEMPLATE_TOKENS_PER_PROMPT + sum(TEMPLATE_TOKENS_PER_MESSAGE + _message_bytes(m) for m in messages)


def _message_bytes(message: object) -> int:
    """What a template renders of a message: its role, name and content (not JSON's punctuation)."""
    if not isinstance(message, dict):
        return _utf8_bytes(message)
    return sum(_utf8_bytes(message[field]) for field in ("role", "name", "content") if message.get(field))


def estimated_prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return TEMPLATE_TOKENS_PER_PROMPT + _utf8_bytes(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids: counted exactly
    if isinstance(prompt, list):
        return sum(estimated_prompt_tokens(p) for p in prompt)
    return TEMPLATE_TOKENS_PER_PROMPT


def _utf8_bytes(value: object) -> int:
    """A message's or prompt's bytes: its text (every field, so a content-parts list counts too)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="replace"))
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", errors="replace"))


def _num_prompts(body: dict, chat: bool) -> int:
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or not prompt or all(isinstance(t, int) for t in prompt):
        return 1
    return len(prompt)


def _int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
