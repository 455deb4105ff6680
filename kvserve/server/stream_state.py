"""Per-choice bookkeeping while streaming: what is new in each engine output, usage so far, finished choices.

Engine outputs carry every choice of a request each time any of them moved; this turns them into the deltas a
client should see: only choices with new text, new logprobs or a finish, and each finish exactly once.
API choice indices run across prompts: prompt i's choice j is i * n + j (OpenAI's and vLLM's numbering).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.request import TokenLogprobs
from kvserve.server.responses import UsageCounter


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    text_offset: int  # characters of this choice already sent before `text`
    logprobs: list[TokenLogprobs] | None  # None: logprobs were not requested
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class StreamState:
    n: int
    usage: UsageCounter = field(default_factory=UsageCounter)
    prompts_seen: set[int] = field(default_factory=set)
    finished_choices: set[int] = field(default_factory=set)
    sent_chars: dict[int, int] = field(default_factory=dict)

    def choice_index(self, prompt_index: int, output: CompletionOutput) -> int:
        return prompt_index * self.n + output.index

    def start_text(self, index: int, num_chars: int) -> None:
        """Text sent before any engine output (echoed prompts)."""
        self.sent_chars[index] = self.sent_chars.get(index, 0) + num_chars

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        if prompt_index not in self.prompts_seen:
            self.prompts_seen.add(prompt_index)
            self.usage.add_prompt(len(output.prompt_token_ids), output.num_cached_tokens, output.tier_loaded_tokens)
        deltas = []
        for choice in output.outputs:
            index = self.choice_index(prompt_index, choice)
            if index in self.finished_choices:
                continue
            self.usage.set_choice_tokens(index, choice.num_tokens)
            logprobs = new_logprobs(choice)
            if not choice.delta_text and not choice.finished and not logprobs:
                continue
            if choice.finished:
                self.finished_choices.add(index)
            offset = self.sent_chars.get(index, 0)
            self.sent_chars[index] = offset + len(choice.delta_text)
            deltas.append(ChoiceDelta(index, choice.delta_text, offset, logprobs, choice.finish_reason,
                                      choice.stop_reason))
        return deltas


def new_logprobs(choice: CompletionOutput) -> list[TokenLogprobs] | None:
    """The logprobs of this output's new tokens."""
    return choice.delta_logprobs


def final_usage(finals: list[RequestOutput], n: int) -> UsageCounter:
    usage = UsageCounter()
    for prompt_index, output in enumerate(finals):
        usage.add_prompt(len(output.prompt_token_ids), output.num_cached_tokens, output.tier_loaded_tokens)
        for choice in output.outputs:
            usage.set_choice_tokens(prompt_index * n + choice.index, len(choice.token_ids))
    return usage
