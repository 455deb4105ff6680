"""PNG plots of one or more runs (matplotlib, Agg backend: no display needed). Each plot takes
{label: data}, so one run and a side-by-side of several use the same functions."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvserve.bench.runner import BenchResult  # noqa: E402
from kvserve.bench.stats import output_token_timeline  # noqa: E402


def _save(figure, axes, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def ttft_cdf(series: dict[str, list[float]], path: Path, title: str = "TTFT CDF") -> Path:
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, values_ms in series.items():
        if values_ms:
            ordered = np.sort(values_ms)
            axes.step(ordered, np.arange(1, len(ordered) + 1) / len(ordered), where="post", label=label)
    axes.set_ylim(0, 1.01)
    return _save(figure, axes, path, title, "time to first token (ms)", "fraction of requests")


def itl_histogram(series: dict[str, list[float]], path: Path, title: str = "inter-token latency") -> Path:
    figure, axes = plt.subplots(figsize=(7, 4))
    present = [v for v in series.values() if v]
    if present:
        high = float(np.percentile(np.concatenate(present), 99.5))
        bins = np.linspace(0, max(high, 1e-3), 60)
        for label, values_ms in series.items():
            if values_ms:
                axes.hist(np.clip(values_ms, 0, high), bins=bins, alpha=0.6, label=label)
    return _save(figure, axes, path, title + " (clipped at p99.5)", "gap between streamed tokens (ms)", "count")


def over_time(series: dict[str, list[tuple[float, float]]], path: Path, title: str, ylabel: str) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        if points:
            times, values = zip(*points)
            axes.plot(times, values, label=label)
    return _save(figure, axes, path, title, "seconds since the run started", ylabel)


def run_series(result: BenchResult) -> dict[str, list]:
    completed = [r for r in result.records if r.ok]
    gauges = result.server.gauges if result.server is not None else []
    return {
        "ttft_ms": [r.ttft_s * 1000 for r in completed if r.ttft_s is not None],
        "itl_ms": [gap * 1000 for r in completed for gap in r.inter_token_latencies_s],
        "throughput": output_token_timeline(result.records),
        "kv_usage": [(g.t_s, g.kv_usage * 100) for g in gauges if g.kv_usage is not None],
    }


def write_plots(results: list[BenchResult], folder: Path, prefix: str = "") -> list[Path]:
    """The four plots of the issue, one line or histogram per run."""
    series = {result.label: run_series(result) for result in results}
    written = [
        ttft_cdf({k: s["ttft_ms"] for k, s in series.items()}, folder / f"{prefix}ttft_cdf.png"),
        itl_histogram({k: s["itl_ms"] for k, s in series.items()}, folder / f"{prefix}itl_hist.png"),
        over_time({k: s["throughput"] for k, s in series.items()}, folder / f"{prefix}throughput.png",
                  "output token throughput", "output tokens/s (1 s bins)"),
    ]
    if any(s["kv_usage"] for s in series.values()):
        written.append(over_time({k: s["kv_usage"] for k, s in series.items()}, folder / f"{prefix}kv_usage.png",
                                 "KV cache usage (server's vllm:kv_cache_usage_perc)", "KV cache used (%)"))
    return written
