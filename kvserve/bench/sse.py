"""Reading an OpenAI streaming response (server-sent events) into a RequestRecord."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.bench.records import RequestRecord


class MalformedStream(Exception):
    pass


class ServerStreamError(Exception):
    """The server reported an error inside the stream (after the 200 status was already sent)."""


DONE = object()


def parse_event_line(line: str) -> dict | object | None:
    """One line of the stream: an event's JSON, DONE, or None for lines that carry nothing (blank, comments)."""
    if not line or line.startswith(":"):
        return None
    if not line.startswith("data:"):
        if line.startswith(("event:", "id:", "retry:")):
            return None
        raise MalformedStream(f"not an SSE line: {line[:80]!r}")
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return DONE
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        raise MalformedStream(f"event is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise MalformedStream(f"event is not a JSON object: {data[:80]!r}")
    return event


@dataclass(slots=True)
class StreamReader:
    """Folds events into the record: output text and its timing, finish reason, usage."""

    record: RequestRecord
    sent_at: float  # perf_counter() when the request was sent
    first_event_at: float | None = None

    def add(self, event: dict, now: float) -> None:
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ServerStreamError(str(message))
        if self.first_event_at is None:
            self.first_event_at = now
        for choice in event.get("choices") or []:
            self._add_choice(choice, now)
        if event.get("usage"):
            self._add_usage(event["usage"])
        if isinstance(event.get("timings"), dict):  # llama-server reports its prompt cache here
            cache_n = event["timings"].get("cache_n")
            if cache_n is not None and self.record.cached_tokens is None:
                self.record.cached_tokens = int(cache_n)

    def _add_choice(self, choice: dict, now: float) -> None:
        delta = choice.get("delta")
        text = (delta or {}).get("content") if delta is not None else choice.get("text")
        if text:
            self.record.output_text += text
            self.record.chunk_times_s.append(now - self.sent_at)
            if self.record.ttft_s is None:
                self.record.ttft_s = now - self.sent_at
        if choice.get("finish_reason"):
            self.record.finish_reason = choice["finish_reason"]

    def _add_usage(self, usage: dict) -> None:
        self.record.prompt_tokens = usage.get("prompt_tokens", self.record.prompt_tokens)
        self.record.completion_tokens = usage.get("completion_tokens", self.record.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.record.cached_tokens = int(details["cached_tokens"])

    def finish(self, now: float) -> None:
        if self.first_event_at is None:
            raise MalformedStream("the stream ended without a single event")
        if self.record.ttft_s is None:  # an empty answer: its first token is whatever came first
            self.record.ttft_s = self.first_event_at - self.sent_at
        self.record.e2e_s = now - self.sent_at
        self.record.ok = True
