"""The advisor's report: a dict (the `--json` output) and the console rendering of it (rich)."""

from __future__ import annotations

import datetime as dt

from rich.console import Console
from rich.table import Table

from kvserve.advise.analysis import Analysis

REPORT_FORMAT = "kvserve-advise"
REPORT_VERSION = 1


def report_dict(analysis: Analysis, source: str) -> dict:
    records, pool = analysis.records, analysis.pool
    times = [record.time for record in records if record.time is not None]
    return {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "source": source,
        "num_prompts": len(records), "num_requests": len({record.request_id for record in records}),
        "first_time": min(times) if times else None, "last_time": max(times) if times else None,
        "pool": {"block_size": pool.block_size, "num_blocks": pool.num_blocks, "hash_algo": pool.hash_algo},
        "hit_rate": {"logged": analysis.logged_hit_rate, "replayed": analysis.replayed.hit_rate},
        "dynamic_spans": [
            {"id": f"span {number}", "kind": span.kind, "message": span.segment, "role": span.role,
             "token_offset": span.token_offset, "char_offset": span.char_offset, "anchor": span.anchor,
             "examples": span.examples, "seen": len(span.sightings)}
            for number, span in enumerate(analysis.spans, start=1)
        ],
        "system_prompt_versions": [
            {"version": version.number, "first_seen": version.first_time, "last_seen": version.last_time,
             "requests": len(version.positions), "hit_rate": version.hit_rate, "text_start": version.text[:80]}
            for version in analysis.versions.versions
        ],
        "version_changes": [
            {"time": change.time, "request": change.position, "from": change.old, "to": change.new,
             "char_offset": change.char_offset, "token_offset": change.token_offset, "old_excerpt": change.old_excerpt, "new_excerpt": change.new_excerpt,
             "hit_rate_before": change.hit_rate_before, "hit_rate_after": change.hit_rate_after}
            for change in analysis.versions.changes
        ],
        "template_variants": [
            {"id": f"template {number}", "role": group.role, "content_start": group.excerpt,
             "variants": group.num_variants, "requests": len(group.heads), "causes": group.causes}
            for number, group in enumerate(analysis.variants, start=1)
        ],
        "fixes": [
            {"finding": fix.finding, "action": fix.action, "hit_rate": fix.hit_rate, "requests_changed": fix.num_changed}
            for fix in analysis.fixes
        ],
    }


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def clock(unix_time: float | None) -> str:
    if unix_time is None:
        return "-"
    return dt.datetime.fromtimestamp(unix_time, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def print_report(report: dict, console: Console) -> None:
    pool = report["pool"]
    blocks = (f"{pool['num_blocks']:,} blocks of {pool['block_size']} tokens" if pool["num_blocks"] else
              f"an unbounded pool of {pool['block_size']}-token blocks (--num-blocks sets a size)")
    span = f", {clock(report['first_time'])} .. {clock(report['last_time'])}" if report["first_time"] else ""
    console.print(f"[bold]kvserve advise[/bold]: {report['num_requests']} requests ({report['num_prompts']} prompts) "
                  f"from {report['source']}{span}")
    console.print(f"replayed on {blocks}, {pool['hash_algo']} block hashes")
    rates = report["hit_rate"]
    console.print(f"prefix-cache hit rate: logged {percent(rates['logged'])}, replayed as logged "
                  f"{percent(rates['replayed'])}")
    if report["fixes"]:
        best = max(report["fixes"], key=lambda fix: fix["hit_rate"])
        console.print(f"[bold]biggest win[/bold]: {best['finding']}: {best['action']} -> "
                      f"[bold]{percent(best['hit_rate'])}[/bold]")
    _print_spans(report, console)
    _print_versions(report, console)
    _print_variants(report, console)
    _print_fixes(report, console)


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


def _print_spans(report: dict, console: Console) -> None:
    spans = report["dynamic_spans"]
    if not spans:
        console.print("dynamic content near the head of prompts: none found")
        return
    table = _table("dynamic content near the head of prompts (where consecutive prompts first differ)",
                   ["", "kind", "where", "token offset", "after", "examples", "seen"])
    for span in spans:
        where = f"message {span['message']} ({span['role']})" if span["role"] != "prompt" else "prompt"
        table.add_row(span["id"], span["kind"], f"{where}, char {span['char_offset']}", str(span["token_offset"]),
                      repr(span["anchor"]), ", ".join(span["examples"]), str(span["seen"]))
    console.print(table)


def _print_versions(report: dict, console: Console) -> None:
    versions = report["system_prompt_versions"]
    if not versions:
        console.print("system prompts: none in these requests")
        return
    table = _table("system-prompt versions", ["", "first seen", "last seen", "requests", "hit rate", "starts with"])
    for version in versions:
        table.add_row(f"v{version['version']}", clock(version["first_seen"]), clock(version["last_seen"]),
                      str(version["requests"]), percent(version["hit_rate"]), repr(version["text_start"][:50]))
    console.print(table)
    changes = report["version_changes"]
    if changes:
        table = _table("system-prompt changes (hit rate of the requests just before and after)",
                       ["when", "change", "differs at", "was", "now", "hit rate before", "after"])
        for change in changes:
            table.add_row(clock(change["time"]), f"v{change['from']} -> v{change['to']}",
                          f"char {change['char_offset']}, token {change['token_offset']}",
                          repr(change["old_excerpt"]), repr(change["new_excerpt"]),
                          percent(change["hit_rate_before"]), percent(change["hit_rate_after"]))
        console.print(table)


def _print_variants(report: dict, console: Console) -> None:
    variants = report["template_variants"]
    if not variants:
        console.print("same content rendered differently: none found")
        return
    table = _table("same content rendered differently", ["", "message", "content starts with", "variants",
                                                          "requests", "why"])
    for group in variants:
        table.add_row(group["id"], group["role"], repr(group["content_start"][:40]), str(group["variants"]),
                      str(group["requests"]), "; ".join(group["causes"]))
    console.print(table)


def _print_fixes(report: dict, console: Console) -> None:
    fixes = report["fixes"]
    if not fixes:
        console.print("nothing to fix found: the misses are prompts that share no prefix")
        return
    rates = report["hit_rate"]
    baseline = rates["logged"] if rates["logged"] is not None else rates["replayed"]
    table = _table("what each fix would reach (replayed through the engine's block hashing)",
                   ["finding", "fix", "hit rate now", "after the fix", "requests changed"])
    for fix in fixes:
        table.add_row(fix["finding"], fix["action"], percent(baseline), f"[bold]{percent(fix['hit_rate'])}[/bold]",
                      str(fix["requests_changed"]))
    console.print(table)
