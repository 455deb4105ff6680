"""`kvserve advise` on a real server's log where every system prompt starts with a timestamp: it finds the
timestamp at the head, and the hit rate it predicts for the fix matches a real run of the fixed workload on a
fresh server with the same flags."""

import json

import pytest
from advise_scenarios import send_chats, timestamp_first, timestamp_last
from serve_process import kvserve_serve, openai_client
from server_harness import scrape_metrics

from kvserve.cli import main

NUM_REQUESTS = 16
MODEL = "tiny-llama"


def serve_flags(folder, log_path) -> list[str]:
    return ["--model", str(folder), "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "1024", "--num-gpu-blocks-override", "256", "--log-requests-file", str(log_path)]


def run_workload(folder, log_path, system_prompt) -> tuple[float, dict[str, float]]:
    with kvserve_serve(log_path.with_suffix(".out"), *serve_flags(folder, log_path)) as server:
        figures = send_chats(openai_client(server.url), MODEL, system_prompt, NUM_REQUESTS)
        metrics = scrape_metrics(server.url)
    return figures.hit_rate, metrics


def advise_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["advise", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def timestamp_runs(tiny_model_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("llama")
    logs = tmp_path_factory.mktemp("advise-logs")
    logged_rate, _ = run_workload(folder, logs / "timestamp.jsonl", timestamp_first)
    fixed_rate, fixed_metrics = run_workload(folder, logs / "fixed.jsonl", timestamp_last)
    return logs, logged_rate, fixed_rate, fixed_metrics


def test_finds_the_timestamp_at_the_head(timestamp_runs, capsys):
    logs, logged_rate, _, _ = timestamp_runs
    report = advise_json(capsys, str(logs / "timestamp.jsonl"))
    assert report["num_requests"] == NUM_REQUESTS
    assert report["hit_rate"]["logged"] == pytest.approx(logged_rate)
    span = report["dynamic_spans"][0]
    assert span["kind"] == "timestamp"
    assert (span["message"], span["role"]) == (0, "system")
    assert span["anchor"] == "Current time: "
    assert span["token_offset"] < 64  # within the first blocks: the rest of the system prompt is never reused
    assert span["seen"] == NUM_REQUESTS - 1


def test_predicted_fix_matches_a_real_run_of_the_fixed_workload(timestamp_runs, capsys):
    logs, logged_rate, fixed_rate, fixed_metrics = timestamp_runs
    report = advise_json(capsys, str(logs / "timestamp.jsonl"))
    move = next(fix for fix in report["fixes"] if fix["finding"] == "span 1" and fix["action"].startswith("move"))
    server_rate = fixed_metrics["vllm:prefix_cache_hits_total"] / fixed_metrics["vllm:prefix_cache_queries_total"]
    assert server_rate == pytest.approx(fixed_rate)  # the usage and the server's counters agree
    assert abs(move["hit_rate"] - fixed_rate) <= 0.02
    assert move["hit_rate"] > logged_rate + 0.3
    assert move["requests_changed"] == NUM_REQUESTS


def test_the_fixed_log_has_no_dynamic_head(timestamp_runs, capsys):
    logs, _, fixed_rate, _ = timestamp_runs
    report = advise_json(capsys, str(logs / "fixed.jsonl"))
    assert report["hit_rate"]["logged"] == pytest.approx(fixed_rate)
    assert abs(report["hit_rate"]["replayed"] - fixed_rate) <= 0.02


def test_console_report_and_plot(timestamp_runs, capsys, tmp_path):
    logs, _, _, _ = timestamp_runs
    plot = tmp_path / "hit_rate.png"
    assert main(["advise", str(logs / "timestamp.jsonl"), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "timestamp" in out and "Current time: " in out and "move the sentence with the timestamp" in out
    assert "biggest win: span 1: remove the sentence with the timestamp" in out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_replay_evicts_as_the_engine_does(tiny_model_dir, tmp_path, capsys):
    """Three system prompts in turn on a pool that holds about two: the engine's LRU evicts, and the replay on
    the logged pool size reproduces its hit rate; on a pool that holds everything it would be higher."""
    folder, _ = tiny_model_dir("llama")
    log_path = tmp_path / "requests.jsonl"
    flags = serve_flags(folder, log_path)
    flags[flags.index("--num-gpu-blocks-override") + 1] = "60"
    flags[flags.index("--max-model-len") + 1] = "512"
    openers = ["You are a helpful", "You are a careful", "You are a patient"]
    with kvserve_serve(tmp_path / "serve.out", *flags) as server:
        figures = send_chats(openai_client(server.url), MODEL,
                             lambda index: timestamp_last(index).replace("You are a helpful", openers[index % 3], 1), 12)
    report = advise_json(capsys, str(log_path))
    assert report["pool"]["num_blocks"] == 60
    assert report["hit_rate"]["logged"] == pytest.approx(figures.hit_rate)
    assert report["hit_rate"]["replayed"] == pytest.approx(figures.hit_rate)
    unbounded = advise_json(capsys, str(log_path), "--num-blocks", "100000")
    assert unbounded["hit_rate"]["replayed"] > figures.hit_rate + 0.03
