"""`kvserve bench`: load-test an OpenAI-compatible server; `kvserve bench compare`; `kvserve bench suite`.

Only argparse is imported up front: `kvserve --help` and the other commands do not pay for httpx or numpy.
Flags follow `vllm bench serve` where it has one (--request-rate, --burstiness, --max-concurrency,
--num-prompts is --num-requests here, --goodput is --slo-ttft-ms / --slo-tpot-ms).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

from kvserve.bench.errors import BenchError
from kvserve.bench.sessions import WORKLOADS
from kvserve.bench.suite_args import add_suite_arguments

SUITE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("subcommands:\n  kvserve bench compare A.json B.json [...]   side-by-side ratios of saved runs\n"
                     "  kvserve bench suite [--quick]               the benchmark suite (benchmarks/run_all.py)")
    add_target_arguments(parser.add_argument_group("target"))
    add_load_arguments(parser.add_argument_group("load"))
    add_workload_arguments(parser.add_argument_group("workload (lengths in tokens)"))
    add_output_arguments(parser.add_argument_group("results"))
    commands = parser.add_subparsers(dest="bench_command", metavar="{compare,suite}")
    compare = commands.add_parser("compare", help="side-by-side ratios of saved runs (--output files)")
    compare.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json")
    suite = commands.add_parser("suite", help="the benchmark suite (python benchmarks/run_all.py)")
    add_suite_arguments(suite, default_out=None)


def add_target_arguments(group) -> None:
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, with or without /v1")
    group.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    group.add_argument("--endpoint", default="auto", choices=["auto", "completions", "chat"],
                       help="auto: chat for multi-turn and conversation files, completions otherwise")
    group.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    group.add_argument("--tokenizer", default=None, metavar="PATH",
                       help="the target's HF folder or tokenizer.json, for exact lengths in tokens (default: "
                            "lengths from a words-per-token ratio measured against the server)")
    group.add_argument("--ignore-eos", action="store_true", help="every answer runs to its max_tokens")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                       help='merged into every request, e.g. \'{"cache_prompt": false}\' for llama-server')
    group.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it counts as "
                       "a timeout")
    group.add_argument("--no-context-check", action="store_true",
                       help="send the workload even if its longest request exceeds the server's max_model_len "
                            "(to measure the server's refusals); by default the run is refused before it starts")


def add_load_arguments(group) -> None:
    group.add_argument("--num-requests", type=int, default=None,
                       help="requests to measure (default 100, unless --duration or --num-sessions says otherwise)")
    group.add_argument("--duration", type=float, default=None, help="seconds; no request starts after them")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="open loop: sessions (requests) per second; default inf: closed loop")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="open loop: 1 Poisson, <1 burstier, >1 more regular (gamma intervals)")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="closed loop: sessions at once; open loop: cap on requests in flight")
    group.add_argument("--warmup", type=int, default=0, help="requests sent first and not measured")
    group.add_argument("--seed", type=int, default=0)


def add_workload_arguments(group) -> None:
    group.add_argument("--workload", default="shared-prefix", help=f"one of: {', '.join(WORKLOADS)}")
    group.add_argument("--system-prompt-len", type=int, default=None,
                       help="shared-prefix (default 2048), multi-turn (default 512)")
    group.add_argument("--user-len", type=int, default=None, help="shared-prefix (32), multi-turn (64)")
    group.add_argument("--output-len", type=int, default=None,
                       help="max_tokens (shared-prefix 64, multi-turn 64, random 128, prefix-repetition 128, "
                            "file: its reference answers)")
    group.add_argument("--input-len", type=int, default=512, help="random")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    group.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition")
    group.add_argument("--suffix-len", type=int, default=256, help="prefix-repetition")
    group.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition")
    group.add_argument("--num-turns", type=int, default=5, help="multi-turn: turns per session")
    group.add_argument("--num-sessions", type=int, default=None,
                       help="multi-turn: sessions (requests = sessions x turns)")
    group.add_argument("--think-time", type=float, default=0.0,
                       help="multi-turn: mean seconds between an answer and the next turn (exponential)")
    group.add_argument("--idle-gap", type=float, default=0.0, help="multi-turn: extra seconds of idleness ...")
    group.add_argument("--idle-gap-every", type=int, default=0, help="... before every k-th turn (0: never)")


def add_output_arguments(group) -> None:
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit")
    group.add_argument("--output", type=Path, default=None, metavar="RESULTS.json")
    group.add_argument("--plots", type=Path, default=None, metavar="DIR",
                       help="write ttft_cdf.png, itl_hist.png, throughput.png, kv_usage.png here")
    group.add_argument("--label", default=None, help="the run's name in tables and comparisons")
    group.add_argument("--metrics-interval", type=float, default=0.5,
                       help="seconds between /metrics polls during the run (KV usage over time)")
    group.add_argument("--no-metrics", action="store_true", help="do not read the server's /metrics")
    group.add_argument("--no-progress", action="store_true", help="no live progress bar")


def config_from_args(args: argparse.Namespace):
    from kvserve.bench.runner import BenchConfig

    num_requests = args.num_requests
    if num_requests is None and args.duration is None and args.num_sessions is None:
        num_requests = 100
    return BenchConfig(
        base_url=args.base_url, workload=args.workload, model=args.model, endpoint=args.endpoint,
        api_key=args.api_key, tokenizer=args.tokenizer, seed=args.seed, num_requests=num_requests,
        duration_s=args.duration, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, warmup=args.warmup, timeout_s=args.timeout,
        check_context=not args.no_context_check,
        ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=args.extra_body,
        system_prompt_len=args.system_prompt_len, user_len=args.user_len, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes, num_turns=args.num_turns,
        num_sessions=args.num_sessions, think_time_s=args.think_time, idle_gap_s=args.idle_gap,
        idle_gap_every=args.idle_gap_every, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        metrics_interval_s=args.metrics_interval, scrape_metrics=not args.no_metrics,
        show_progress=not args.no_progress, label=args.label,
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        if args.bench_command == "compare":
            from kvserve.bench.compare import compare_files

            compare_files(args.results, console)
            return 0
        if args.bench_command == "suite":
            return run_suite(args)
        return run_bench(args, console)
    except BenchError as exc:
        print(f"kvserve bench: error: {exc}", file=sys.stderr)
        return 2


def run_bench(args: argparse.Namespace, console) -> int:
    from kvserve.bench.report import print_report, write_json
    from kvserve.bench.runner import run_benchmark

    result = run_benchmark(config_from_args(args))
    print_report(result, console)
    if args.output is not None:
        write_json(result, args.output)
        console.print(f"results: {args.output}")
    if args.plots is not None:
        from kvserve.bench.plots import write_plots

        for path in write_plots([result], args.plots):
            console.print(f"plot: {path}")
    return 0 if result.summary.num_completed else 1


def run_suite(args: argparse.Namespace) -> int:
    """benchmarks/run_all.py lives in the repository, not the package: found next to an editable install."""
    if not SUITE_SCRIPT.is_file():
        raise BenchError(f"the suite needs a kvserve checkout (looked for {SUITE_SCRIPT}); "
                         "run python benchmarks/run_all.py from one")
    spec = importlib.util.spec_from_file_location("kvserve_benchmarks_run_all", SUITE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    if args.out is None:
        args.out = SUITE_SCRIPT.parent
    return int(module.run_suite(args, command="kvserve bench suite" + suite_flags(args)) or 0)


def suite_flags(args: argparse.Namespace) -> str:
    """The flags as typed, for the record in RESULTS.md."""
    flags = []
    for name in ("quick", "skip_offline", "skip_llama_server"):
        if getattr(args, name):
            flags.append("--" + name.replace("_", "-"))
    for name in ("model", "llama_server", "llama_model"):
        if getattr(args, name):
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return "".join(" " + flag for flag in flags)
