"""`kvserve bench compare a.json b.json [c.json ...]`: runs side by side, each as a ratio to the first."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvserve.bench.errors import BenchError

# (label, path into the results JSON, higher is better)
ROWS: list[tuple[str, tuple[str, ...], bool]] = [
    ("requests completed", ("summary", "num_completed"), True),
    ("requests failed", ("summary", "num_failed"), False),
    ("duration (s)", ("summary", "duration_s"), False),
    ("request throughput (req/s)", ("summary", "request_throughput"), True),
    ("output tokens/s", ("summary", "output_token_throughput"), True),
    ("total tokens/s", ("summary", "total_token_throughput"), True),
    ("goodput (req/s)", ("summary", "goodput"), True),
    *[(f"{name} {stat} (ms)", ("summary", key, stat), False)
      for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
      for stat in ("mean", "p50", "p95", "p99")],
    ("cache hit rate (usage)", ("summary", "cache_hit_rate"), True),
    ("cache hit rate (server)", ("server", "prefix_cache_hit_rate"), True),
    ("preemptions", ("server", "preemptions"), False),
    ("peak KV usage", ("server", "peak_kv_usage"), False),
]


def load_results(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read {path}: {exc}") from None
    if data.get("format") != "kvserve-bench":
        raise BenchError(f"{path} is not a `kvserve bench --output` file")
    return data


def lookup(data: dict, path: tuple[str, ...]) -> float | None:
    value = data
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, int | float) else None


def format_value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"


def format_ratio(base: float | None, other: float | None, higher_is_better: bool) -> str:
    if base is None or other is None or base == 0:
        return "-"
    ratio = other / base
    if abs(ratio - 1) < 0.005:
        return f"{ratio:.2f}x"
    better = (ratio > 1) == higher_is_better
    return f"[{'green' if better else 'red'}]{ratio:.2f}x[/]"


def comparison_table(runs: list[tuple[str, dict]]) -> Table:
    table = Table(title=f"ratios to {runs[0][0]}", title_justify="left")
    table.add_column("metric")
    for index, (name, _) in enumerate(runs):
        table.add_column(name, justify="right")
        if index:
            table.add_column("ratio", justify="right")
    for label, path, higher_is_better in ROWS:
        values = [lookup(data, path) for _, data in runs]
        if all(value is None for value in values):
            continue
        cells = [format_value(values[0])]
        for value in values[1:]:
            cells += [format_value(value), format_ratio(values[0], value, higher_is_better)]
        table.add_row(label, *cells)
    return table


def compare_files(paths: list[Path], console: Console) -> None:
    if len(paths) < 2:
        raise BenchError("compare needs at least two results files")
    runs = [(data.get("label") or path.stem, data) for path in paths for data in [load_results(path)]]
    names = [name for name, _ in runs]
    if len(set(names)) < len(names):  # same label twice (same workload, same URL): tell them apart by file
        runs = [(path.name, data) for path, (_, data) in zip(paths, runs)]
    console.print(comparison_table(runs))
