"""Engine logprobs -> OpenAI's two logprobs shapes (completions: parallel lists; chat: a list of token objects).

JSON has no -inf, and a token whose logprob underflowed would otherwise break the response, so non-finite
values are clamped to -9999.0 as vLLM does.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from kvserve.engine.request import TokenLogprobs
from kvserve.model.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0
REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback tokens


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the rest are shifted past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + shift)
            shift += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


class TokenTexts:
    """Per-token display text and exact bytes, cached (the vocabulary is bounded)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int, as_token_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_token_id else self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            token_bytes = self._exact_bytes(token_id, text)
            if REPLACEMENT_CHAR in text and token_bytes != list(text.encode("utf-8")):
                # Part of a multi-byte character: OpenAI's spelling, which keeps such tokens distinct.
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)
            entry = (text, token_bytes)
            self._cache[token_id] = entry
        return entry

    def _exact_bytes(self, token_id: int, text: str) -> list[int]:
        if REPLACEMENT_CHAR not in text:
            return list(text.encode("utf-8"))
        # A token holding part of a multi-byte character: recover its bytes from the raw vocabulary entry.
        piece = self.tokenizer.id_to_token(token_id) or ""
        match = _BYTE_TOKEN.match(piece)
        if match:
            return [int(match.group(1), 16)]
        decoder = _byte_level_decoder()
        if piece and all(ch in decoder for ch in piece):
            return [decoder[ch] for ch in piece]
        return list(text.encode("utf-8"))


def completion_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, initial_offset: int,
                        as_token_ids: bool) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; top_logprobs include the sampled token."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    offset = initial_offset
    for entry in entries:
        token = texts.text(entry.token_id, as_token_ids)
        tokens.append(token)
        token_logprobs.append(finite(entry.logprob))
        top = {texts.text(tid, as_token_ids): finite(lp) for tid, lp in entry.top}
        top.setdefault(token, finite(entry.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def echoed_prompt_logprobs(entries: list[TokenLogprobs | None], first_token_id: int, texts: TokenTexts,
                           as_token_ids: bool) -> dict:
    """The prompt's tokens in completion_logprobs' shape, for echo: the first token has no logprob (null)."""
    first = texts.text(first_token_id, as_token_ids)
    scored = completion_logprobs(entries[1:], texts, len(first), as_token_ids)
    return {"text_offset": [0] + scored["text_offset"], "token_logprobs": [None] + scored["token_logprobs"],
            "tokens": [first] + scored["tokens"], "top_logprobs": [None] + scored["top_logprobs"]}


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], texts: TokenTexts) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {"logprob", "rank",
    "decoded_token"}} for the prompt token and the top k."""
    result: list[dict | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        scored = {token_id: (logprob, rank) for rank, (token_id, logprob) in enumerate(entry.top, start=1)}
        scored[entry.token_id] = (entry.logprob, entry.rank)
        result.append({str(token_id): {"logprob": finite(logprob), "rank": rank, "decoded_token": texts.text(token_id)}
                       for token_id, (logprob, rank) in scored.items()})
    return result


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, num_top: int, as_token_ids: bool) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}."""
    content = []
    for entry in entries:
        content.append({
            "token": texts.text(entry.token_id, as_token_ids),
            "logprob": finite(entry.logprob),
            "bytes": texts.bytes(entry.token_id),
            "top_logprobs": [
                {"token": texts.text(tid, as_token_ids), "logprob": finite(lp), "bytes": texts.bytes(tid)}
                for tid, lp in entry.top[:num_top]
            ],
        })
    return {"content": content, "refusal": None}
