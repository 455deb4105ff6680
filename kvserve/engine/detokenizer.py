"""Incremental detokenization with stop strings.

Byte-level BPE tokens can end inside a multi-byte character; decoding a token on its own would then emit a
replacement character. We decode a short window of recent tokens and only emit text once it no longer ends in
an incomplete character. Stop strings are searched in the text; while a request runs we hold back the last
(longest stop string - 1) characters so a client never receives the beginning of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded again on every step to give the tokenizer context (leading spaces, merges across tokens).
CONTEXT_TOKENS = 6


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)  # output tokens only
    text: str = ""  # the output text so far (truncated at a stop string once one matched)
    prefix_offset: int = 0
    read_offset: int = 0
    num_sent_chars: int = 0  # chars of `text` already handed out as deltas
    longest_stop: int = field(init=False)  # the characters a running request holds back, plus one

    def __post_init__(self) -> None:
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    def append(self, token_id: int) -> str | None:
        """Adds one output token; returns the stop string it completed, if any."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return None  # an incomplete character (or nothing visible yet): wait for the next token
        new_text = full_text[len(prefix_text) :]
        search_start = max(0, len(self.text) - self.longest_stop + 1)
        self.text += new_text
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)
        return self._check_stop(search_start)

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, holds back what could still become a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.num_sent_chars, len(self.text) - self.longest_stop + 1)
        out = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""

    def _check_stop(self, search_start: int) -> str | None:
        for stop in self.stop:
            index = self.text.find(stop, search_start)
            if index != -1:
                end = index + len(stop) if self.include_stop_str_in_output else index
                self.text = self.text[:end]
                return stop
        return None
