"""Prompt sets shared by the benchmarks, built from token ids so every engine sees exactly the same input."""

from __future__ import annotations

import random
from dataclasses import dataclass

PARAGRAPH = (
    "The history of computing is a story of memory. Early machines stored a few words in mercury delay lines, "
    "then in magnetic cores threaded by hand. Every generation since has traded speed for capacity and back "
    "again: registers, caches, main memory, disks and tapes form a hierarchy that programs must respect. "
    "Language models added a new layer to this story. To produce each word they look back at every earlier "
    "word through attention, and the keys and values of those words are kept in a cache so they need not be "
    "computed twice. That cache grows with every token of every conversation, and on a busy server it, not "
    "the arithmetic, decides how many people can be served at once. "
)
QUESTIONS = [
    "Summarize the passage in one sentence.", "What is the main idea?", "Name two kinds of memory mentioned.",
    "Why does the cache grow?", "Explain attention to a child.", "What limits a busy server?",
    "Give the passage a title.", "List three keywords.",
]


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def long_text_tokens(tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(tokenizer.encode(PARAGRAPH, add_special_tokens=False))
    return ids[:num_tokens]


def shared_prefix_workload(tokenizer, num_requests: int = 32, prefix_len: int = 400, output_len: int = 64) -> list[BenchRequest]:
    """(a): prompts of ~430 tokens whose first `prefix_len` are shared, exactly `output_len` output tokens."""
    prefix = long_text_tokens(tokenizer, prefix_len)
    requests = []
    for index in range(num_requests):
        suffix = tokenizer.encode(f"\nRequest {index}: {QUESTIONS[index % len(QUESTIONS)]} Answer briefly.",
                                  add_special_tokens=False)
        requests.append(BenchRequest(prefix + suffix, output_len))
    return requests


def mixed_workload(tokenizer, num_requests: int = 256, seed: int = 0) -> list[BenchRequest]:
    """(b): prompts of 16-512 tokens (random slices of long text, so no two share a prefix), outputs 16-256."""
    rng = random.Random(seed)
    text = long_text_tokens(tokenizer, 4096)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(16, 512)
        start = rng.randint(0, len(text) - length)
        requests.append(BenchRequest(text[start : start + length], rng.randint(16, 256)))
    return requests
