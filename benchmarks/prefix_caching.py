"""Prefix caching on vs off, in one run, on the demo model (SmolLM2-135M, bf16):

    python benchmarks/prefix_caching.py [--model PATH] [--quick] [--compare-tiers]

(a) the seed's scenario: one >= 1,024-token system prompt + short user turns, 64 requests at concurrency 16;
(b) multi-turn chats: each turn resends the whole history (system prompt, earlier turns, the model's answers).
Requests are driven in a closed loop straight into the engine (no HTTP), so the figures are the engine's.
Prints TTFT p50/p95, output tok/s, the on/off ratios and the prefix-cache hit rate.
--compare-tiers: both engines cache prefixes, one with a 4 GiB host tier below its pool (which nothing here
ever needs: the pool holds every prefix), so the ratios are what the tier costs when nothing returns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import PARAGRAPH, QUESTIONS  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402


@dataclass(slots=True)
class Record:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    output_tokens: int


@dataclass(slots=True)
class Session:
    """A conversation: yields the token ids of its next request, given the previous answer."""

    messages: list[dict]
    user_turns: list[str]
    turn: int = 0
    records: list[Record] = field(default_factory=list)

    def next_prompt(self, tokenizer) -> list[int] | None:
        if self.turn >= len(self.user_turns):
            return None
        self.messages.append({"role": "user", "content": self.user_turns[self.turn]})
        text = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.turn += 1


def system_prompt(min_tokens: int, tokenizer) -> str:
    text = "You are a helpful assistant for a library. Use the reference below.\n\n"
    while len(tokenizer.encode(text)) < min_tokens:
        text += PARAGRAPH
    return text


def run(llm: LLM, sessions: list[Session], concurrency: int, max_tokens: int, ignore_eos: bool = True
        ) -> tuple[list[Record], float]:
    """Closed loop: at most `concurrency` sessions have a request in flight; a session's next turn starts
    when its previous answer is complete."""
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    pending: Iterator[Session] = iter(sessions)
    in_flight: dict[str, tuple[Session, float, int]] = {}
    counter = 0

    def submit(session: Session) -> None:
        nonlocal counter
        prompt = session.next_prompt(tokenizer)
        if prompt is None:
            refill()
            return
        request_id = f"r{counter}"
        counter += 1
        in_flight[request_id] = (session, time.perf_counter(), len(prompt))
        engine.add_request(request_id, prompt, params)

    def refill() -> None:
        session = next(pending, None)
        if session is not None:
            submit(session)

    for _ in range(concurrency):
        refill()
    first_token: dict[str, float] = {}
    records: list[Record] = []
    started = time.perf_counter()
    while in_flight:
        for output in engine.step():
            now = time.perf_counter()
            first_token.setdefault(output.request_id, now)
            if not output.finished:
                continue
            session, sent, prompt_tokens = in_flight.pop(output.request_id)
            completion = output.outputs[0]
            records.append(Record(session.turn, prompt_tokens, output.num_cached_tokens,
                                  first_token[output.request_id] - sent, len(completion.token_ids)))
            session.answered(completion.text)
            submit(session)
    return records, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[Record], elapsed: float, from_turn: int = 0) -> dict[str, float]:
    ttfts = [r.ttft for r in records]
    later = [r for r in records if r.turn >= from_turn]
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": percentile(ttfts, 95),
        "tok_s": sum(r.output_tokens for r in records) / elapsed,
        "hit_rate": sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later)),
    }


def scenario_a(tokenizer, num_requests: int) -> list[Session]:
    system = system_prompt(1024, tokenizer)
    return [Session([{"role": "system", "content": system}], [f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"])
            for i in range(num_requests)]


def scenario_b(tokenizer, num_sessions: int, num_turns: int) -> list[Session]:
    system = system_prompt(256, tokenizer)
    return [Session([{"role": "system", "content": system}],
                    [f"Session {s}, turn {t}: {QUESTIONS[(s + t) % len(QUESTIONS)]}" for t in range(num_turns)])
            for s in range(num_sessions)]


def print_comparison(title: str, on: dict[str, float], off: dict[str, float], hit_note: str,
                     labels: tuple[str, str] = ("caching on", "caching off")) -> None:
    print(f"\n{title}")
    print(f"{'':22} {labels[0]:>12} {labels[1]:>12} {'on/off':>8}")
    for key, label, fmt in [("ttft_p50", "TTFT p50 (s)", "{:12.3f}"), ("ttft_p95", "TTFT p95 (s)", "{:12.3f}"),
                            ("tok_s", "output tok/s", "{:12.1f}")]:
        print(f"{label:22} {fmt.format(on[key])} {fmt.format(off[key])} {on[key] / off[key]:8.2f}")
    print(f"{'prefix-cache hit rate':22} {on['hit_rate']:12.1%} {off['hit_rate']:12.1%}   {hit_note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--compare-tiers", action="store_true", help="host tier on vs off, prefix caching on in both")
    args = parser.parse_args()
    common = dict(dtype="bfloat16", kv_cache_memory=2.0, max_model_len=4096, max_num_seqs=64)
    if args.compare_tiers:
        engines = {True: LLM(args.model, kv_offloading_size=4.0, **common), False: LLM(args.model, **common)}
    else:
        engines = {flag: LLM(args.model, enable_prefix_caching=flag, **common) for flag in (True, False)}
    tokenizer = engines[True].get_tokenizer()
    num_a, sessions_b, turns_b = (16, 4, 3) if args.quick else (64, 8, 5)
    results = {}
    for flag, llm in engines.items():
        run(llm, scenario_a(tokenizer, 4), 4, 4)  # warm-up
        llm.reset_prefix_cache()
        rec_a, t_a = run(llm, scenario_a(tokenizer, num_a), 16, 32)
        llm.reset_prefix_cache()
        # Chats end answers at the model's end-of-turn token, as a chat client would see them.
        rec_b, t_b = run(llm, scenario_b(tokenizer, sessions_b, turns_b), sessions_b, 64, ignore_eos=False)
        results[flag] = (summarize(rec_a, t_a), summarize(rec_b, t_b, from_turn=1))
    prompt_a = sum(len(tokenizer.encode(s.messages[0]["content"])) for s in scenario_a(tokenizer, 1))
    labels = ("host tier on", "tiers off") if args.compare_tiers else ("caching on", "caching off")
    print_comparison(f"(a) {num_a} requests, ~{prompt_a}-token system prompt + short user turn, concurrency 16, 32 out",
                     results[True][0], results[False][0], "(all requests)", labels)
    print_comparison(f"(b) {sessions_b} chats x {turns_b} turns, whole history resent, answers up to 64 tokens",
                     results[True][1], results[False][1], "(from turn 2)", labels)


if __name__ == "__main__":
    main()
