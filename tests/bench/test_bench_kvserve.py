"""`kvserve bench` against a live kvserve (tiny random model): its figures agree with the server's own counters,
multi-turn sessions resend their history, errors and a server stopped mid-run are reported, the CLI writes its
results, plots and comparisons."""

from __future__ import annotations

import json
import threading

import pytest
from server_harness import slowed, start_server, wait_until

from kvserve.bench.errors import BenchError
from kvserve.bench.runner import BenchConfig, run_benchmark
from kvserve.cli import main

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512)
    yield running
    running.stop()


def bench(url: str, **overrides):
    config = BenchConfig(base_url=url, show_progress=False, ignore_eos=True, **overrides)
    return run_benchmark(config)


def counters(server) -> dict[str, float]:
    metrics = server.metrics()
    return {name: metrics[name] for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                                             "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


def test_shared_prefix_figures_match_the_server_counters(server):
    before = counters(server)
    result = bench(server.url, workload="shared-prefix", system_prompt_len=128, user_len=16, output_len=8,
                   num_requests=12, max_concurrency=4, warmup=2)
    counted = deltas(before, counters(server))
    summary, records = result.summary, result.records
    assert summary.num_completed == 12 and summary.errors_by_kind == {}
    # Warm-up and calibration probes happen before the run; the counters above include them, the server view not.
    warmup_and_probes = counted["vllm:prompt_tokens_total"] - summary.prompt_tokens
    assert warmup_and_probes > 0
    view = result.server
    assert view.prompt_tokens == summary.prompt_tokens == sum(r.prompt_tokens for r in records)
    assert view.generation_tokens == summary.completion_tokens == 12 * 8
    assert view.prefix_cache_hits == summary.cached_tokens == sum(r.cached_tokens for r in records)
    assert summary.cached_tokens > 0.5 * summary.prompt_tokens  # the system prompt was cached by the warm-up
    assert view.prefix_cache_hit_rate == pytest.approx(summary.cached_tokens / view.prefix_cache_queries)
    assert view.preemptions == 0 and view.peak_kv_usage is not None  # a fast run may see the pool idle only


def test_counters_match_exactly_from_a_cold_server(tiny_model_dir):
    """No warm-up, no probes (exact lengths with --tokenizer): the server's counter deltas around the whole
    run, scraped by the test itself, are the load tester's sums."""
    folder, _ = tiny_model_dir("llama")
    cold = start_server(folder, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512)
    try:
        before = counters(cold)
        result = bench(cold.url, workload="prefix-repetition", tokenizer=str(folder), prefix_len=64,
                       suffix_len=16, num_prefixes=2, output_len=4, num_requests=8, max_concurrency=2)
        counted = deltas(before, counters(cold))
    finally:
        cold.stop()
    summary = result.summary
    assert summary.num_completed == 8
    assert counted["vllm:prompt_tokens_total"] == summary.prompt_tokens
    assert counted["vllm:generation_tokens_total"] == summary.completion_tokens == 8 * 4
    assert counted["vllm:prefix_cache_hits_total"] == summary.cached_tokens > 0
    assert all(abs(r.prompt_tokens - (64 + 16)) <= 2 for r in result.records)  # exact lengths, +- the seams


def test_multi_turn_resends_history_with_the_actual_answers(server):
    result = bench(server.url, workload="multi-turn", system_prompt_len=32, user_len=8, output_len=6,
                   num_turns=3, num_sessions=3, max_concurrency=3, think_time_s=0.05)
    assert result.target["endpoint"] == "chat"
    assert result.summary.num_completed == 9
    for session in range(3):
        turns = sorted((r for r in result.records if r.session_index == session), key=lambda r: r.turn_index)
        assert [r.turn_index for r in turns] == [0, 1, 2]
        for earlier, later in zip(turns, turns[1:]):
            # the history: the earlier prompt, its answer, a new user turn; most of it found in the cache
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.completion_tokens
            assert later.cached_tokens >= (earlier.prompt_tokens // 16 - 1) * 16
            assert later.start_s >= earlier.start_s + earlier.e2e_s
    assert result.server.prefix_cache_hits == result.summary.cached_tokens


def test_too_long_prompts_are_counted_as_400s_and_the_rest_measured(server):
    before = counters(server)
    # Up to 570 + 7 tokens against max_model_len 512: sent anyway (--no-context-check) to measure the refusals.
    result = bench(server.url, workload="random", input_len=300, range_ratio=0.9, output_len=4,
                   num_requests=16, max_concurrency=4, check_context=False)
    counted = deltas(before, counters(server))
    summary = result.summary
    assert set(summary.errors_by_kind) == {"http_400"}
    assert 0 < summary.num_failed < 16 and summary.num_completed + summary.num_failed == 16
    assert all("maximum context length" in r.error_message for r in result.records if not r.ok)
    assert result.server.prompt_tokens == summary.prompt_tokens  # refused prompts never reached the engine
    assert counted["vllm:prompt_tokens_total"] >= summary.prompt_tokens


def test_the_console_shows_the_first_message_of_each_error_kind(server, capsys):
    argv = ["bench", "--base-url", server.url, "--workload", "random", "--input-len", "300", "--range-ratio", "0.9",
            "--output-len", "4", "--ignore-eos", "--num-requests", "16", "--max-concurrency", "4", "--no-metrics",
            "--no-progress", "--no-context-check"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "errors: http_400" in shown
    # The server's own words (the error body's message) beside the kind, cut to one sensible line
    errors = shown[shown.index("first message"):shown.index("latency (ms)")]
    assert "http_400" in errors and "maximum context length is 512" in " ".join(errors.split())


def test_a_workload_longer_than_the_servers_context_is_refused_before_sending(server, tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama")
    before = counters(server)
    argv = ["bench", "--base-url", server.url, "--tokenizer", str(folder), "--workload", "shared-prefix",
            "--system-prompt-len", "600", "--num-requests", "4", "--no-progress"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("kvserve bench: error: ")
    for text in ("max_model_len of 512", "about 696 tokens (632 prompt + 64 output)", "--max-model-len",
                 "--system-prompt-len", "--user-len", "--output-len"):
        assert text in error
    assert counters(server) == before  # nothing was sent (--tokenizer: no calibration probes either)
    # A conversation is refused for its last turn, which resends the whole history (its first turn would fit):
    # 300 system + 3 user turns of 64 + 2 answers of up to 64, then 64 out.
    with pytest.raises(BenchError, match=r"about 684 tokens .*--num-turns"):
        bench(server.url, workload="multi-turn", tokenizer=str(folder), system_prompt_len=300, user_len=64,
              output_len=64, num_turns=3, num_sessions=2)
    assert counters(server) == before


def test_a_server_stopped_mid_run_is_reported(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    doomed = start_server(folder, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512, shutdown_timeout_s=0.2)
    doomed.engine.engine.step = slowed(doomed.engine.engine.step, 0.02)

    def stop_after_two_waves() -> None:
        # Stopped by progress, not after a fixed time, so a slow machine cannot finish nothing (or everything)
        # first: 8 of the 40 requests done, 32 x 30 tokens at >= 20 ms a step still to come.
        wait_until(lambda: doomed.engine.snapshot.stats.finished_by_reason.get("length", 0) >= 8, timeout_s=60)
        doomed.stop()

    stopper = threading.Thread(target=stop_after_two_waves)
    stopper.start()
    try:
        # --tokenizer: no calibration probes, so the engine's finished requests are the run's own.
        result = bench(doomed.url, workload="random", tokenizer=str(folder), input_len=16, output_len=30,
                       num_requests=40, max_concurrency=4, timeout_s=20, scrape_metrics=False)
    finally:
        stopper.join()
    summary = result.summary
    # No timeout among the errors: the stop failed the rest at once, none waited out its --timeout.
    assert summary.num_completed > 0 and summary.num_failed > 0
    assert set(summary.errors_by_kind) <= {"connection", "malformed_stream", "stream_error", "http_503"}
    assert summary.errors_by_kind.get("connection", 0) > 0


def test_cli_writes_results_plots_and_compares(server, tmp_path, capsys):
    output, plots = tmp_path / "run.json", tmp_path / "plots"
    argv = ["bench", "--base-url", f"{server.url}/v1", "--workload", "shared-prefix", "--system-prompt-len", "64",
            "--user-len", "8", "--output-len", "6", "--ignore-eos", "--num-requests", "6", "--max-concurrency", "3",
            "--slo-ttft-ms", "60000", "--output", str(output), "--plots", str(plots), "--no-progress"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "TTFT" in shown and "prefix cache hit rate" in shown and "goodput" in shown
    data = json.loads(output.read_text())
    assert data["summary"]["num_completed"] == 6 and data["summary"]["goodput"] > 0
    assert data["server"]["prompt_tokens"] == data["summary"]["prompt_tokens"]
    assert len(data["requests"]) == 6 and data["target"]["model"] == "tiny-llama"
    assert {p.name for p in plots.iterdir()} == {"ttft_cdf.png", "itl_hist.png", "throughput.png", "kv_usage.png"}
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())
    assert main(["bench", "compare", str(output), str(output)]) == 0
    table = capsys.readouterr().out
    assert "TTFT p95" in table and "1.00x" in table


def test_multi_turn_on_a_server_with_a_host_tier_reports_the_tier(tiny_model_dir, capsys):
    """Sessions that evict each other from a small pool come back through the host tier: the bench's server
    view counts the blocks loaded and the bytes each way, and the console shows them."""
    folder, _ = tiny_model_dir("llama")
    tiered = start_server(folder, max_model_len=320, num_gpu_blocks_override=20, kv_offloading_size=0.01)
    try:
        result = bench(tiered.url, workload="multi-turn", system_prompt_len=8, user_len=60, output_len=4,
                       num_turns=2, num_sessions=4, max_concurrency=4, think_time_s=0.0)
        view = result.server
        assert result.summary.num_completed == 8
        assert view.tier_hits["host"] > 0 and view.tier_bytes_loaded["host"] > 0
        assert view.tier_bytes_offloaded["host"] >= view.tier_bytes_loaded["host"]
        from rich.console import Console

        from kvserve.bench.report import print_report

        print_report(result, Console(width=200))
        assert "KV tier host: blocks loaded" in capsys.readouterr().out
    finally:
        tiered.stop()
