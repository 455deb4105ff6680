"""`kvserve advise LOG.jsonl`: why prefix caching misses, and the hit rate each fix would reach.

Input errors (a missing file, an empty log, a model that cannot be read) end with one line on stderr and exit
status 1; malformed lines are counted, skipped and warned about when the rest of the file is good.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_BAD_INPUT = 1
REPORT_WIDTH = 160


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", type=Path, metavar="LOG.jsonl",
                        help="a `kvserve serve --log-requests-file` log, or OpenAI chat/completions request bodies, "
                             "one JSON object per line")
    parser.add_argument("--model", default=None,
                        help="the model whose tokenizer and chat template render the prompts (default: the server "
                             "log's model, else the demo model); only read when a prompt must be tokenized")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the log's, else 16)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="the pool's capacity in blocks, for the replay's LRU (default: the log's; request "
                             "bodies: unbounded)")
    parser.add_argument("--min-sightings", type=int, default=2,
                        help="report a dynamic span seen between at least this many consecutive prompt pairs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    parser.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                        help="write the hit rate over time, with system-prompt changes marked")


def run(args: argparse.Namespace) -> int:
    from kvserve.advise.records import AdviseError

    try:
        return _run(args)
    except AdviseError as exc:
        print(f"kvserve advise: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve.advise.analysis import analyse
    from kvserve.advise.records import AdviseError, read_log
    from kvserve.advise.rendering import Renderer, tokenize_records
    from kvserve.advise.report import print_report, report_dict

    for name in ("block_size", "num_blocks", "min_sightings"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise AdviseError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    log = read_log(args.log)
    if log.num_bad_lines:
        warn(f"skipped {log.num_bad_lines} malformed line{'s' * (log.num_bad_lines > 1)} ({log.first_bad_line})")
    log.pool.block_size = args.block_size or log.pool.block_size
    log.pool.num_blocks = args.num_blocks or log.pool.num_blocks
    renderer = Renderer(args.model or _logged_model(log.pool.model_path))
    log.records, num_failed, first_failure = tokenize_records(log.records, renderer)
    if num_failed:
        warn(f"skipped {num_failed} request{'s' * (num_failed > 1)} the chat template could not render "
             f"({first_failure})")
    if not log.records:
        raise AdviseError(f"{args.log}: no request could be rendered")
    analysis = analyse(log, renderer, args.min_sightings)
    if analysis.replayed.num_unplaced:
        warn(f"{analysis.replayed.num_unplaced} requests do not fit a pool of {log.pool.num_blocks} blocks of "
             f"{log.pool.block_size} tokens and count as misses in the replay (--num-blocks)")
    if log.from_server_log and analysis.fixes:  # fixes were rendered: with the server's template and tokenizer?
        _check_renderer(log.records, renderer)
    report = report_dict(analysis, str(args.log))
    if args.plot is not None:
        from kvserve.advise.plot import plot_hit_rate

        report["plot"] = str(plot_hit_rate(analysis, args.plot))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        # Wide enough for the tables when piped to a file; a terminal keeps its own width.
        print_report(report, Console(width=None if sys.stdout.isatty() else REPORT_WIDTH))
    return 0


def _check_renderer(records, renderer) -> None:
    from kvserve.advise.rendering import count_render_mismatches

    mismatches, sampled = count_render_mismatches(records, renderer)
    if mismatches:
        warn(f"{mismatches} of {sampled} sampled prompts render to other token ids with "
             f"{renderer.model or 'the demo model'} than the server logged: pass the server's --model, or the "
             "predicted hit rates of fixes are approximate")


def _logged_model(model_path: str | None) -> str | None:
    """The server log's model when it is still on this machine; else the demo model."""
    return model_path if model_path and Path(model_path).exists() else None


def warn(message: str) -> None:
    print(f"kvserve advise: warning: {message}", file=sys.stderr)
