"""The load tester's parts on their own: arrival process, workloads, prompt files, SSE parsing, statistics,
comparisons; and the rule that `kvserve.bench` speaks HTTP only."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from kvserve.bench.arrivals import arrival_intervals
from kvserve.bench.compare import comparison_table
from kvserve.bench.errors import BenchError
from kvserve.bench.file_workload import FileWorkload
from kvserve.bench.prompts import chat_messages, completion_prompt
from kvserve.bench.records import RequestRecord
from kvserve.bench.report import ERROR_MESSAGE_CHARS, one_line
from kvserve.bench.sse import DONE, MalformedStream, parse_event_line
from kvserve.bench.stats import Slo, distribution_ms, output_token_timeline, summarize
from kvserve.bench.text import WordText
from kvserve.bench.workloads import (
    MultiTurnWorkload, PrefixRepetitionWorkload, RandomWorkload, SharedPrefixWorkload,
)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_intervals_have_the_rate_and_spread_asked_for(burstiness):
    intervals = np.fromiter(itertools.islice(arrival_intervals(50.0, burstiness, seed=3), 20000), float)
    assert 1 / intervals.mean() == pytest.approx(50.0, rel=0.03)
    assert intervals.std() / intervals.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_workloads_are_deterministic_per_seed_and_index():
    text = WordText(1.0)
    first, again = SharedPrefixWorkload(text, seed=7), SharedPrefixWorkload(text, seed=7)
    assert first.session(3) == again.session(3)
    assert first.session(3).turns[0].user_text != first.session(4).turns[0].user_text
    assert first.session(3).system_prompt == first.session(4).system_prompt
    assert len(first.system_prompt.split()) == 2048
    assert SharedPrefixWorkload(text, seed=8).system_prompt != first.system_prompt


def test_word_lengths_follow_the_calibrated_ratio():
    text = WordText(tokens_per_word=2.0)
    assert len(text.text(random.Random(0), 100).split()) == 50
    assert text.count_tokens("a b c") == 6


def test_random_workload_lengths_stay_in_range():
    workload = RandomWorkload(WordText(1.0), seed=0, input_len=100, output_len=20, range_ratio=0.5)
    sessions = [workload.session(i) for i in range(200)]
    lengths = [len(s.turns[0].user_text.split()) for s in sessions]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 30
    assert all(10 <= s.turns[0].max_tokens <= 30 for s in sessions)


def test_prefix_repetition_uses_each_prefix_equally_in_shuffled_order():
    workload = PrefixRepetitionWorkload(WordText(1.0), seed=0, num_requests=40, prefix_len=30, suffix_len=5,
                                        num_prefixes=4)
    prefixes = [next(p for p in workload.prefixes if s.turns[0].user_text.startswith(p))
                for s in map(workload.session, range(40))]
    assert Counter(prefixes) == {p: 10 for p in workload.prefixes}
    assert prefixes != sorted(prefixes, key=workload.prefixes.index)  # shuffled, as vLLM's


def test_multi_turn_sessions_think_and_idle():
    workload = MultiTurnWorkload(WordText(1.0), seed=0, num_turns=6, think_time_s=0.5, idle_gap_s=100.0,
                                 idle_gap_every=3)
    delays = [turn.delay_s for turn in workload.session(0).turns]
    assert delays[0] == 0
    assert delays[3] > 100 and all(0 < d < 100 for i, d in enumerate(delays) if i not in (0, 3))


def test_each_turn_carries_the_whole_history():
    session = MultiTurnWorkload(WordText(1.0), seed=0, num_turns=3, user_len=3).session(0)
    messages = chat_messages(session, 2, ["first answer", "second answer"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"] == "first answer" and messages[5]["content"] == session.turns[2].user_text
    prompt = completion_prompt(session, 1, ["first answer"])
    assert prompt.startswith(session.system_prompt) and "Assistant: first answer" in prompt
    assert prompt.endswith("Assistant:")


def test_prompt_files_hold_prompts_and_sharegpt_conversations(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 7},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "one two three"}, {"from": "human", "value": "more"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b"}]},
    ]
    path.write_text("\n".join(map(json.dumps, lines)) + "\n\n")
    workload = FileWorkload(path, WordText(1.0))
    assert workload.prefers_chat
    plain, chat, short = workload.session(0), workload.session(1), workload.session(2)
    assert plain.turns[0].user_text == "hello there" and plain.turns[0].max_tokens == 7
    assert chat.system_prompt == "be brief" and [t.user_text for t in chat.turns] == ["hi", "more"]
    assert [t.max_tokens for t in chat.turns] == [3, 128]  # the reference answer's length; none for the last
    assert short.turns[0].max_tokens == 2
    assert workload.session(3).turns == plain.turns and workload.session(3).index == 3  # the file repeats
    assert FileWorkload(path, WordText(1.0), output_len=5).session(1).turns[0].max_tokens == 5


def test_a_bad_prompt_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(BenchError, match="bad.jsonl:2"):
        FileWorkload(path, WordText(1.0))


def test_sse_lines():
    assert parse_event_line("data: [DONE]") is DONE
    assert parse_event_line("") is None and parse_event_line(": keep-alive") is None
    assert parse_event_line('data: {"choices": []}') == {"choices": []}
    with pytest.raises(MalformedStream):
        parse_event_line("data: {not json")
    with pytest.raises(MalformedStream):
        parse_event_line("<html>")


def record(ttft: float, e2e: float, chunks: list[float], ok: bool = True, kind: str | None = None) -> RequestRecord:
    result = RequestRecord(0, 0, start_s=0.0, max_tokens=len(chunks), ok=ok, error_kind=kind, ttft_s=ttft,
                           e2e_s=e2e, chunk_times_s=chunks, prompt_tokens=10, completion_tokens=len(chunks),
                           cached_tokens=4)
    return result


def failed(kind: str, message: str, start_s: float) -> RequestRecord:
    result = RequestRecord(0, 0, start_s=start_s, max_tokens=4)
    result.fail(kind, message)
    return result


def test_summary_latencies_throughput_goodput_and_errors():
    records = [record(0.1, 0.5, [0.1, 0.3, 0.5]), record(0.2, 1.2, [0.2, 0.7, 1.2]),
               record(None, None, [], ok=False, kind="http_400"), record(None, None, [], ok=False, kind="timeout")]
    summary = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=150, tpot_ms=300))
    assert summary.num_sent == 4 and summary.num_completed == 2
    assert summary.errors_by_kind == {"http_400": 1, "timeout": 1}
    assert summary.ttft.mean == pytest.approx(150) and summary.ttft.p50 == pytest.approx(150)
    assert summary.tpot.mean == pytest.approx((200 + 500) / 2)
    assert summary.itl.count == 4 and summary.itl.max == pytest.approx(500)
    assert summary.request_throughput == 1.0 and summary.output_token_throughput == 3.0
    assert summary.total_token_throughput == (20 + 6) / 2
    assert summary.cached_tokens == 8 and summary.cache_hit_rate == 0.4
    assert summary.num_within_slo == 1 and summary.goodput == 0.5


def test_each_error_kind_keeps_its_first_message_and_the_console_cuts_long_ones():
    records = [failed("http_400", "second", 0.2), failed("http_400", "first", 0.1),
               failed("connection", "ConnectError: refused", 0.3)]
    summary = summarize(records, duration_s=1.0)
    assert summary.first_error_by_kind == {"connection": "ConnectError: refused", "http_400": "first"}
    assert one_line("a\n  multi-line\tmessage") == "a multi-line message"
    cut = one_line("x" * 1000)
    assert len(cut) == ERROR_MESSAGE_CHARS and cut.endswith("…")


def test_longest_request_of_each_workload(tmp_path):
    text = WordText(1.0)
    assert SharedPrefixWorkload(text, 0, 100, 10, 20).longest_request().total_tokens == 130
    # the last of 3 turns resends the system prompt, 3 user turns and 2 answers of up to 20 tokens
    longest = MultiTurnWorkload(text, 0, num_turns=3, system_prompt_len=100, user_len=10,
                                output_len=20).longest_request()
    assert (longest.prompt_tokens, longest.max_output_tokens) == (100 + 3 * 10 + 2 * 20, 20)
    random_workload = RandomWorkload(text, 0, input_len=100, output_len=20, range_ratio=0.5)
    longest = random_workload.longest_request()
    assert (longest.prompt_tokens, longest.max_output_tokens) == (150, 30) and "--range-ratio" in longest.flags
    drawn = [random_workload.session(i).turns[0] for i in range(300)]
    assert max(len(t.user_text.split()) for t in drawn) <= 150 and max(t.max_tokens for t in drawn) <= 30
    assert PrefixRepetitionWorkload(text, 0, 10, 64, 16, 2, 8).longest_request().total_tokens == 88
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "one two three", "max_tokens": 5}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c d"},
                      {"role": "assistant", "content": "w x y"}, {"role": "user", "content": "e f"},
                      {"role": "assistant", "content": "z"}]}) + "\n")
    longest = FileWorkload(path, text).longest_request()
    # the second turn: system 2 + users 4 + 2, the first answer's 3, then 1 out
    assert (longest.prompt_tokens, longest.max_output_tokens) == (2 + 4 + 2 + 3, 1)


def test_percentiles_match_numpy():
    values = list(np.random.default_rng(0).exponential(1.0, 1001))
    dist = distribution_ms(values)
    assert dist.p99 == pytest.approx(np.percentile(values, 99) * 1000)
    assert distribution_ms([]) is None


def test_throughput_timeline_counts_every_token_once():
    records = [record(0.1, 2.5, [0.1 * i for i in range(1, 26)])]
    timeline = output_token_timeline(records, bin_s=1.0)
    assert sum(rate for _, rate in timeline) == pytest.approx(25)


def test_comparison_shows_ratios_to_the_first_run():
    base = {"summary": {"output_token_throughput": 100.0, "ttft": {"p95": 200.0}}, "server": None}
    other = {"summary": {"output_token_throughput": 150.0, "ttft": {"p95": 100.0}}, "server": None}
    console = Console(record=True, width=200)
    console.print(comparison_table([("a", base), ("b", other)]))
    text = console.export_text()
    assert "1.50x" in text and "0.50x" in text and "preemptions" not in text


def test_bench_speaks_http_only():
    """DESIGN.md: bench imports nothing from the engine or the model (nor torch)."""
    code = ("import sys, pkgutil, importlib, kvserve.bench as b\n"
            "for m in pkgutil.iter_modules(b.__path__): importlib.import_module('kvserve.bench.' + m.name)\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('kvserve.engine', 'kvserve.model'))]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
