"""benchmarks/run_all.py writes RESULTS.md (tables, plots, machine) from its runs; checked on made-up runs, so
no server starts here (the suite itself is run by hand: `python benchmarks/run_all.py --quick`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvserve.bench.metrics_scrape import GaugeSample, ServerView
from kvserve.bench.records import RequestRecord
from kvserve.bench.runner import BenchResult
from kvserve.bench.stats import summarize

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"


def load_suite():
    spec = importlib.util.spec_from_file_location("run_all_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def made_up_run(label: str, ttft_s: float) -> BenchResult:
    records = [RequestRecord(i, 0, start_s=0.1 * i, max_tokens=4, ok=True, ttft_s=ttft_s, e2e_s=ttft_s + 0.3,
                             chunk_times_s=[ttft_s + 0.1 * k for k in range(4)], prompt_tokens=100,
                             completion_tokens=4, cached_tokens=50) for i in range(10)]
    server = ServerView(prompt_tokens=1000, prefix_cache_queries=1000, prefix_cache_hits=500,
                        prefix_cache_hit_rate=0.5, preemptions=0, peak_kv_usage=0.25,
                        gauges=[GaugeSample(0.0, 0.1, 1, 0), GaugeSample(1.0, 0.25, 4, 0)])
    return BenchResult(label, {}, {"model": "m", "endpoint": "completions"}, {}, summarize(records, 2.0), server,
                       records)


def test_results_md_has_every_section_and_its_plots(tmp_path):
    suite = load_suite()
    results = suite.SuiteResults(suite.machine_info(), suite.QUICK, quick=True)
    results.offline = ("model: demo\nworkload   kvserve tok/s  transformers   ratio\n"
                       "(a) 32 x ~430-token prompts, 400 shared, 64 out                11.6          10.4   1.12x")
    for caching in (True, False):
        spec = suite.kvserve_spec(caching, None)
        results.servers[spec.key] = spec
        for workload in suite.workloads(suite.QUICK) + ([suite.seed_workload(suite.QUICK)] if caching else []):
            results.runs[(spec.key, workload.key)] = made_up_run(f"{spec.key}/{workload.key}",
                                                                 0.2 if caching else 0.8)
    results.notes.append("llama-server: not on PATH, so it was not measured.")
    text = suite.write_results_md(results, tmp_path, "python benchmarks/run_all.py --quick").read_text()
    for heading in ("## Machine", "## 1. Offline throughput", "## 2. Prefix caching on vs off",
                    "## 3. The seed's run", "## 4. llama.cpp llama-server", "Quick smoke run"):
        assert heading in text, heading
    assert "| (a) 32 x ~430-token prompts, 400 shared, 64 out | 11.6 | 10.4 | 1.12x |" in text
    assert "| on / off |  | 0.25x | 0.25x |" in text  # TTFT ratios of the made-up runs
    assert "**P95 TTFT (kvserve, prefix caching on): 200.0 ms**" in text
    assert "Not on PATH" in text and "torch" in text
    images = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(images) == 7 and all((tmp_path / image).is_file() for image in images)


def test_a_rerun_keeps_the_figures_measured_by_hand(tmp_path):
    suite = load_suite()
    results = suite.SuiteResults(suite.machine_info(), suite.QUICK, quick=True)
    hand = f"{suite.HAND_MARKER}\n\n## 7. Measured by hand\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    (tmp_path / "RESULTS.md").write_text("# old suite run\n\n## 1. stale figures\n\n" + hand)
    text = suite.write_results_md(results, tmp_path, "python benchmarks/run_all.py --quick").read_text()
    assert "stale figures" not in text and "## Machine" in text
    assert text.endswith(hand) and text.count(suite.HAND_MARKER) == 1
    # The repository's own RESULTS.md has the marker, so its hand-measured sections survive a rerun.
    assert suite.HAND_MARKER in (SUITE.parent / "RESULTS.md").read_text()
