"""`kvserve advise --plot out.png`: the hit rate over time, with each system-prompt change marked."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from kvserve.advise.analysis import Analysis

ROLLING_REQUESTS = 8  # the curve is the hit rate of the last this many requests, token-weighted


def rolling_hit_rates(hits: list[int], queries: list[int], window: int = ROLLING_REQUESTS) -> list[float]:
    rates = []
    for end in range(1, len(hits) + 1):
        start = max(0, end - window)
        total = sum(queries[start:end])
        rates.append(sum(hits[start:end]) / total if total else 0.0)
    return rates


def plot_hit_rate(analysis: Analysis, path: Path) -> Path:
    from kvserve.bench.plots import _save, plt  # the load tester's Agg setup and figure conventions

    records = analysis.records
    use_time = all(record.time is not None for record in records)
    xs = [dt.datetime.fromtimestamp(r.time, dt.timezone.utc) for r in records] if use_time else list(range(len(records)))
    label = "logged" if analysis.logged_hit_rate is not None else "replayed"
    rates = rolling_hit_rates(*analysis.hits_and_queries)
    figure, axes = plt.subplots(figsize=(9, 4))
    axes.plot(xs, [100 * rate for rate in rates], marker=".", label=f"hit rate, {label} (last {ROLLING_REQUESTS})")
    if analysis.fixes:
        best = max(analysis.fixes, key=lambda fix: fix.hit_rate)
        predicted = rolling_hit_rates(best.replayed.hit_tokens, best.replayed.prompt_tokens)
        axes.plot(xs, [100 * rate for rate in predicted], linestyle=":", color="tab:green",
                  label=f"predicted: {best.finding}, {best.action[:50]}")
    for change in analysis.versions.changes:
        x = xs[change.position]
        axes.axvline(x, color="tab:red", linestyle="--", alpha=0.7)
        axes.annotate(f"v{change.old}->v{change.new}", (x, 102), color="tab:red", fontsize=8, ha="left",
                      annotation_clip=False)
    axes.set_ylim(0, 100)
    if use_time:
        from matplotlib.dates import DateFormatter

        axes.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
        figure.autofmt_xdate()
    return _save(figure, axes, path, "prefix-cache hit rate over time; dashed: system-prompt changes",
                 "time (UTC)" if use_time else "request", "prefix-cache hit rate (%)")
