"""Prompts to token ids as the server makes them: the server's own chat rendering and the model's tokenizer.

Loaded lazily: a server log needs no tokenizer until a fix rewrites a prompt; request bodies need one at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.advise.records import CHAT, AdviseError, PromptRecord


@dataclass(slots=True)
class Renderer:
    """Renders and tokenizes chat messages and completion prompts with one model's tokenizer and template."""

    model: str | None  # a local path; None: the demo model
    _tokenizer: Any = field(default=None, init=False)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from kvserve.config import ModelLoadError
            from kvserve.model.loader import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.model)
            except ModelLoadError as exc:
                raise AdviseError(f"--model: {exc}") from None
        return self._tokenizer

    def render_chat(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        from kvserve.server.prompts import render_chat, template_message
        from kvserve.server.protocol import ChatCompletionRequest

        known = ChatCompletionRequest.model_fields
        request = ChatCompletionRequest.model_validate(
            {key: value for key, value in body.items() if key in known and key != "chat_template"}
            | {"messages": messages})
        tools = body.get("tools")
        if tools:  # kvserve's server refuses tools; other servers' bodies may carry them, rendered as the template says
            chat = [template_message(index, message) for index, message in enumerate(request.messages)]
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=request.add_generation_prompt,
                                                      tools=tools)
        else:
            text = render_chat(self.tokenizer, request)
        return text, self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def encode_text(self, record: PromptRecord, text: str) -> list[int]:
        """A prompt given as text, tokenized as the record's endpoint does (chat templates write their own BOS)."""
        add_special_tokens = record.body.get("add_special_tokens", record.kind != CHAT)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render(self, record: PromptRecord) -> tuple[str | None, list[int]]:
        """The record's prompt text and token ids as the server would make them from its body."""
        if record.kind == CHAT:
            return self.render_chat(record.body, record.messages or [])
        if isinstance(record.prompt, str):
            return record.prompt, self.encode_text(record, record.prompt)
        return None, list(record.prompt or [])


def tokenize_records(records: list[PromptRecord], renderer: Renderer) -> tuple[list[PromptRecord], int, str | None]:
    """Fills token ids in where the input had none; returns the records that rendered, how many did not, and
    the first reason."""
    kept: list[PromptRecord] = []
    num_failed, first_failure = 0, None
    for record in records:
        if record.token_ids is None:
            try:
                record.prompt_text, record.token_ids = renderer.render(record)
            except AdviseError:  # the model itself cannot be read: nothing will render
                raise
            except Exception as exc:  # pydantic ValidationError, APIError from the template: this record only
                num_failed += 1
                first_failure = first_failure or f"{record.request_id}: {_one_line(exc)}"
                continue
        kept.append(record)
    return kept, num_failed, first_failure


def _one_line(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


RENDER_CHECK_SAMPLE = 16


def count_render_mismatches(records: list[PromptRecord], renderer: Renderer) -> tuple[int, int]:
    """Of a sample of logged prompts, how many this model's template and tokenizer render to other token ids
    than the server did: fixes are only predicted exactly when the answer is 0."""
    sample = [record for record in records if record.kind == CHAT or isinstance(record.prompt, str)]
    sample = sample[:: max(1, len(sample) // RENDER_CHECK_SAMPLE)][:RENDER_CHECK_SAMPLE]
    mismatches = 0
    for record in sample:
        try:
            mismatches += renderer.render(record)[1] != record.token_ids
        except AdviseError:
            raise
        except Exception:  # a template that cannot render it renders it differently
            mismatches += 1
    return mismatches, len(sample)
