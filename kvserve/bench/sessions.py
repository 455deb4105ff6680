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


@dataclass(slots=True, frozen=True)
class RequestSize:
    """A workload's longest request, in tokens as the workload sizes its text (the few tokens a chat template or
    a transcript's separators add are not counted, so a limit is only enforced where it is surely exceeded)."""

    prompt_tokens: int
    max_output_tokens: int
    flags: str  # the bench's flags that set these lengths, for a message that says what to change

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


class Workload(Protocol):
    name: str
    prefers_chat: bool  # --endpoint auto: chat for conversations, completions for single prompts

    def session(self, index: int) -> Session:
        """Session `index`, the same for the same seed; any index >= 0 is valid (--duration runs go on)."""
        ...

    def describe(self) -> dict: ...

    def longest_request(self) -> RequestSize:
        """Prompt plus max output of the longest request any session sends (a conversation's last turn)."""
        ...


def conversation_turn_size(session: Session, turn_index: int, count_tokens) -> tuple[int, int]:
    """(prompt tokens, max output tokens) of one turn: the system prompt, every user turn so far and the answers
    before it at their max_tokens, the most they can be."""
    turns = session.turns[: turn_index + 1]
    prompt = count_tokens(session.system_prompt) if session.system_prompt else 0
    prompt += sum(count_tokens(turn.user_text) for turn in turns)
    prompt += sum(turn.max_tokens for turn in turns[:-1])
    return prompt, turns[-1].max_tokens


def session_rng(seed: int, workload: str, index: int | str) -> random.Random:
    # Seeding with a string hashes it (sha512): stable across runs and Python versions, unlike hash().
    return random.Random(f"{seed}:{workload}:{index}")
