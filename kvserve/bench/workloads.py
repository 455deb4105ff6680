"""The synthetic workloads: shared-prefix, multi-turn, random, prefix-repetition. Lengths are in tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.bench.sessions import RequestSize, Session, Turn, session_rng
from kvserve.bench.text import TextMaker


@dataclass(slots=True)
class SharedPrefixWorkload:
    """One system prompt shared by every request (an app's instructions), then a short unique user message."""

    text: TextMaker
    seed: int
    system_prompt_len: int = 2048
    user_len: int = 32
    output_len: int = 64
    name: str = "shared-prefix"
    prefers_chat: bool = False
    system_prompt: str = field(init=False)

    def __post_init__(self) -> None:
        self.system_prompt = self.text.text(session_rng(self.seed, self.name, "system"), self.system_prompt_len)

    def session(self, index: int) -> Session:
        user = self.text.text(session_rng(self.seed, self.name, index), self.user_len)
        return Session(index, [Turn(user, self.output_len)], self.system_prompt)

    def describe(self) -> dict:
        return {"workload": self.name, "system_prompt_len": self.system_prompt_len, "user_len": self.user_len,
                "output_len": self.output_len}

    def longest_request(self) -> RequestSize:
        return RequestSize(self.system_prompt_len + self.user_len, self.output_len,
                           "--system-prompt-len, --user-len, --output-len")


@dataclass(slots=True)
class MultiTurnWorkload:
    """Chat sessions: a shared system prompt, `num_turns` user turns, each sent after the previous answer and a
    think time (exponentially distributed around its mean); optionally a long idle gap every k turns, the pause
    that makes a server evict (or offload) an idle session's KV."""

    text: TextMaker
    seed: int
    num_turns: int = 5
    system_prompt_len: int = 512
    user_len: int = 64
    output_len: int = 64
    think_time_s: float = 0.0
    idle_gap_s: float = 0.0
    idle_gap_every: int = 0  # 0: no idle gaps
    name: str = "multi-turn"
    prefers_chat: bool = True
    system_prompt: str = field(init=False)

    def __post_init__(self) -> None:
        self.system_prompt = self.text.text(session_rng(self.seed, self.name, "system"), self.system_prompt_len)

    def session(self, index: int) -> Session:
        rng = session_rng(self.seed, self.name, index)
        turns = []
        for turn_index in range(self.num_turns):
            delay = 0.0
            if turn_index > 0:
                delay = rng.expovariate(1 / self.think_time_s) if self.think_time_s > 0 else 0.0
                if self.idle_gap_every and turn_index % self.idle_gap_every == 0:
                    delay += self.idle_gap_s
            turns.append(Turn(self.text.text(rng, self.user_len), self.output_len, delay))
        return Session(index, turns, self.system_prompt)

    def describe(self) -> dict:
        return {"workload": self.name, "num_turns": self.num_turns, "system_prompt_len": self.system_prompt_len,
                "user_len": self.user_len, "output_len": self.output_len, "think_time_s": self.think_time_s,
                "idle_gap_s": self.idle_gap_s, "idle_gap_every": self.idle_gap_every}

    def longest_request(self) -> RequestSize:
        # The last turn resends the system prompt, every user turn and every earlier answer (at most output_len).
        prompt = self.system_prompt_len + self.num_turns * self.user_len + (self.num_turns - 1) * self.output_len
        return RequestSize(prompt, self.output_len, "--system-prompt-len, --user-len, --output-len, --num-turns")


def length_in_range(rng, length: int, range_ratio: float) -> int:
    """vLLM's --random-range-ratio: uniform in [length * (1 - r), length * (1 + r)]."""
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def longest_in_range(length: int, range_ratio: float) -> int:
    """The most length_in_range can draw."""
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(1, low, high)


@dataclass(slots=True)
class RandomWorkload:
    """Independent prompts of random words (no shared prefix) with input/output lengths drawn from ranges."""

    text: TextMaker
    seed: int
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    name: str = "random"
    prefers_chat: bool = False

    def session(self, index: int) -> Session:
        rng = session_rng(self.seed, self.name, index)
        prompt = self.text.text(rng, length_in_range(rng, self.input_len, self.range_ratio))
        return Session(index, [Turn(prompt, length_in_range(rng, self.output_len, self.range_ratio))])

    def describe(self) -> dict:
        return {"workload": self.name, "input_len": self.input_len, "output_len": self.output_len,
                "range_ratio": self.range_ratio}

    def longest_request(self) -> RequestSize:
        flags = "--input-len, --output-len" + (", --range-ratio" if self.range_ratio else "")
        return RequestSize(longest_in_range(self.input_len, self.range_ratio),
                           longest_in_range(self.output_len, self.range_ratio), flags)


@dataclass(slots=True)
class PrefixRepetitionWorkload:
    """vLLM's prefix-repetition dataset: `num_prefixes` random prefixes, each used by an equal share of the
    requests (num_requests // num_prefixes), each followed by a random suffix; the order is shuffled. Beyond
    `num_requests` (a --duration run) the same scheme repeats with a new shuffle."""

    text: TextMaker
    seed: int
    num_requests: int
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    name: str = "prefix-repetition"
    prefers_chat: bool = False
    prefixes: list[str] = field(init=False)
    _orders: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        assert self.num_prefixes >= 1
        self.prefixes = [self.text.text(session_rng(self.seed, self.name, f"prefix-{p}"), self.prefix_len)
                         for p in range(self.num_prefixes)]

    @property
    def block_len(self) -> int:
        return self.num_prefixes * max(1, self.num_requests // self.num_prefixes)

    def prefix_index(self, index: int) -> int:
        block = index // self.block_len
        if block not in self._orders:
            order = [p for p in range(self.num_prefixes) for _ in range(self.block_len // self.num_prefixes)]
            session_rng(self.seed, self.name, f"order-{block}").shuffle(order)
            self._orders[block] = order
        return self._orders[block][index % self.block_len]

    def session(self, index: int) -> Session:
        suffix = self.text.text(session_rng(self.seed, self.name, index), self.suffix_len)
        prompt = f"{self.prefixes[self.prefix_index(index)]} {suffix}"
        return Session(index, [Turn(prompt, self.output_len)])

    def describe(self) -> dict:
        return {"workload": self.name, "prefix_len": self.prefix_len, "suffix_len": self.suffix_len,
                "num_prefixes": self.num_prefixes, "output_len": self.output_len}

    def longest_request(self) -> RequestSize:
        return RequestSize(self.prefix_len + self.suffix_len, self.output_len,
                           "--prefix-len, --suffix-len, --output-len")
