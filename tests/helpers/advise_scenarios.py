"""The advisor's scenarios as real traffic: chat requests whose system prompt starts with a timestamp (and the
same workload with the timestamp moved after the shared instructions), and a system prompt edited midway.
Shared by the advise tests and benchmarks/advise.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Long enough that the shared part is most of each prompt, in words the tiny test tokenizer knows.
INSTRUCTIONS = " ".join([
    "You are a helpful assistant for the KV cache team. Answer in short sentences.",
    "Paged attention reads blocks through a block table. KV caches hold the keys and values of every past token.",
    "The quick brown fox jumps over the lazy dog. Always cite the block size and say when a prefix is cached.",
] * 2)
EDITED_INSTRUCTIONS = INSTRUCTIONS.replace("You are a helpful assistant", "You are a friendly assistant", 1)


def timestamp(index: int) -> str:
    seconds = 11 + 7 * index
    return f"2026-12-01T14:{3 + seconds // 60:02d}:{seconds % 60:02d}Z"


def question(index: int) -> str:
    return f"Question {index}: what does block {index * 7} hold, and why?"


def timestamp_first(index: int) -> str:
    return f"Current time: {timestamp(index)}. {INSTRUCTIONS}"


def timestamp_last(index: int) -> str:
    """The fix as a user makes it: the same sentence, after the static instructions."""
    return f"{INSTRUCTIONS} Current time: {timestamp(index)}."


@dataclass(slots=True)
class RunFigures:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def send_chats(client, model: str, system_prompt: Callable[[int], str], num_requests: int, first: int = 0,
               max_tokens: int = 8) -> RunFigures:
    """One request at a time, as a client would send them; the usage's cached tokens summed."""
    figures = RunFigures(0, 0)
    for index in range(first, first + num_requests):
        reply = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": system_prompt(index)}, {"role": "user", "content": question(index)}])
        figures.prompt_tokens += reply.usage.prompt_tokens
        figures.cached_tokens += reply.usage.prompt_tokens_details.cached_tokens
    return figures
