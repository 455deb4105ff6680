"""A workload is a deterministic source of sessions; a session is one or more turns of one conversation.

Single-shot workloads (shared-prefix, random, prefix-repetition, prompt files) make one-turn sessions.
Turn k of a multi-turn session is sent after the answer to turn k-1, and carries the whole history.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

WORKLOADS = ("shared-prefix", "multi-turn", "random", "prefix-repetition", "file:PATH.jsonl")


@dataclass(slots=True)
class Turn:
    user_text: str
    max_tokens: int
    delay_s: float = 0.0  # think time (and any idle gap) between the previous answer and this turn


@dataclass(slots=True)
class Session:
    index: int
    turns: list[Turn]
    system_prompt: str | None = None


class Workload(Protocol):
    name: str
    prefers_chat: bool  # --endpoint auto: chat for conversations, completions for single prompts

    def session(self, index: int) -> Session:
        """Session `index`, the same for the same seed; any index >= 0 is valid (--duration runs go on)."""
        ...

    def describe(self) -> dict: ...


def session_rng(seed: int, workload: str, index: int | str) -> random.Random:
    # Seeding with a string hashes it (sha512): stable across runs and Python versions, unlike hash().
    return random.Random(f"{seed}:{workload}:{index}")
