"""A run's results: the console table (rich) and the JSON file that `kvserve bench compare` reads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvserve.bench.client import ENDPOINT_PATHS
from kvserve.bench.runner import BenchResult
from kvserve.bench.stats import Distribution

FORMAT_VERSION = 1
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))
ERROR_MESSAGE_CHARS = 200  # enough for a server's sentence; a stack trace or an HTML page is cut


def result_dict(result: BenchResult) -> dict:
    records = []
    for record in result.records:
        fields = dataclasses.asdict(record)
        fields.pop("output_text")  # the answers are not results, and can be long
        fields.pop("chunk_times_s")
        fields["output_tokens"] = record.output_tokens
        records.append(fields)
    server = dataclasses.asdict(result.server) if result.server is not None else None
    return {
        "format": "kvserve-bench", "version": FORMAT_VERSION, "label": result.label, "started": result.started,
        "target": result.target, "workload": result.workload, "config": result.config,
        "summary": dataclasses.asdict(result.summary), "server": server, "notes": result.notes,
        "requests": records,
    }


def write_json(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_dict(result), indent=1) + "\n")


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def latency_table(summary) -> Table:
    table = Table(title="latency (ms)", title_justify="left")
    for column in ("", "mean", "p50", "p95", "p99", "max", "n"):
        table.add_column(column, justify="right" if column else "left")
    for key, label in LATENCIES:
        dist: Distribution | None = getattr(summary, key)
        if dist is None:
            table.add_row(label, *["-"] * 6)
        else:
            table.add_row(label, ms(dist.mean), ms(dist.p50), ms(dist.p95), ms(dist.p99), ms(dist.max),
                          str(dist.count))
    return table


def throughput_table(result: BenchResult) -> Table:
    summary = result.summary
    table = Table(title=f"{result.label}: {result.target['model']} via {ENDPOINT_PATHS[result.target['endpoint']]}",
                  title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    rows = [
        ("requests completed / sent", f"{summary.num_completed} / {summary.num_sent}"),
        ("duration (s)", number(summary.duration_s)),
        ("request throughput (req/s)", number(summary.request_throughput, 3)),
        ("output token throughput (tok/s)", number(summary.output_token_throughput, 1)),
        ("total token throughput (tok/s)", number(summary.total_token_throughput, 1)),
        ("prompt / completion tokens", f"{summary.prompt_tokens:,} / {summary.completion_tokens:,}"),
        ("cached prompt tokens (usage)", "-" if summary.cached_tokens is None
         else f"{summary.cached_tokens:,} ({percent(summary.cache_hit_rate)})"),
    ]
    if summary.goodput is not None:
        slo = " and ".join(part for part in (
            f"TTFT <= {summary.slo_ttft_ms:g} ms" if summary.slo_ttft_ms is not None else "",
            f"TPOT <= {summary.slo_tpot_ms:g} ms" if summary.slo_tpot_ms is not None else "") if part)
        rows.append((f"goodput ({slo}) (req/s)", f"{number(summary.goodput, 3)} "
                     f"({summary.num_within_slo}/{summary.num_sent})"))
    for kind, count in summary.errors_by_kind.items():
        rows.append((f"errors: {kind}", str(count)))
    for row in rows:
        table.add_row(*row)
    return table


def one_line(text: str, limit: int = ERROR_MESSAGE_CHARS) -> str:
    """A message as one line of at most `limit` characters (whitespace and newlines collapsed)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def errors_table(summary) -> Table | None:
    """What went wrong, not only how often: each kind's first message (the HTTP error body's message, the
    exception's text otherwise)."""
    if not summary.errors_by_kind:
        return None
    table = Table(title="errors (first message of each kind)", title_justify="left")
    table.add_column("kind", style="red", no_wrap=True)
    table.add_column("requests", justify="right")
    table.add_column("first message", overflow="fold")
    for kind, count in summary.errors_by_kind.items():
        table.add_row(kind, str(count), one_line(summary.first_error_by_kind.get(kind) or "-"))
    return table


def server_table(result: BenchResult) -> Table | None:
    server = result.server
    if server is None:
        return None
    table = Table(title="server's view (/metrics, over the run)", title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    table.add_row("prompt / generation tokens", f"{number(server.prompt_tokens, 0)} / "
                  f"{number(server.generation_tokens, 0)}")
    table.add_row("prefix cache hits / queries (tokens)", f"{number(server.prefix_cache_hits, 0)} / "
                  f"{number(server.prefix_cache_queries, 0)}")
    table.add_row("prefix cache hit rate", percent(server.prefix_cache_hit_rate))
    table.add_row("preemptions", number(server.preemptions, 0))
    for tier, hits in server.tier_hits.items():
        table.add_row(f"KV tier {tier}: blocks loaded / MiB loaded / MiB offloaded",
                      f"{number(hits, 0)} / {number(server.tier_bytes_loaded.get(tier, 0) / 2**20, 1)} / "
                      f"{number(server.tier_bytes_offloaded.get(tier, 0) / 2**20, 1)}")
    table.add_row("peak KV cache usage", percent(server.peak_kv_usage))
    table.add_row("peak running / waiting requests", f"{number(server.peak_running, 0)} / "
                  f"{number(server.peak_waiting, 0)}")
    return table


def print_report(result: BenchResult, console: Console) -> None:
    console.print(throughput_table(result))
    errors = errors_table(result.summary)
    if errors is not None:
        console.print(errors)
    console.print(latency_table(result.summary))
    table = server_table(result)
    if table is not None:
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", style="yellow")
