"""`kvserve advise` end to end on the timestamp scenario, on the demo model (SmolLM2-135M) by default:

    python benchmarks/advise.py [--model PATH] [--num-requests 32] [--max-concurrency 1]

1. a fresh `kvserve serve --log-requests-file` serves a workload whose system prompt starts with
   "Current time: <timestamp>." before a long shared instruction, sent by `kvserve bench --workload file:...`;
2. `kvserve advise --json` reads the log: where the prompts diverge, and the hit rate after moving the sentence
   with the timestamp after the instruction, replayed through the engine's block hashing;
3. a second fresh server, same flags, serves the fixed workload (the same requests, the timestamp moved).
Prints the logged hit rate, the predicted hit rate after the fix and the real one side by side; all three count
the same requests (kvserve bench's two calibration probes included), as the server's counters do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from advise_scenarios import question, timestamp  # noqa: E402
from serve_process import kvserve_serve  # noqa: E402
from server_harness import scrape_metrics  # noqa: E402
from workloads import PARAGRAPH  # noqa: E402

INSTRUCTIONS = (PARAGRAPH * 2).strip()


def workload_file(path: Path, num_requests: int, timestamp_first: bool) -> Path:
    with path.open("w") as lines:
        for index in range(num_requests):
            sentence = f"Current time: {timestamp(index)}."
            system = f"{sentence} {INSTRUCTIONS}" if timestamp_first else f"{INSTRUCTIONS} {sentence}"
            lines.write(json.dumps({"messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": question(index)}]}) + "\n")
    return path


def serve_and_bench(out: Path, name: str, serve_flags: list[str], workload: Path, args) -> float:
    """The server's own hit rate (vllm:prefix_cache_hits_total / queries_total) over the whole run."""
    log_flags = ["--log-requests-file", str(out / f"{name}.jsonl")]
    with kvserve_serve(out / f"{name}.out", *serve_flags, *log_flags) as server:
        subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "--base-url", server.url, "--workload",
                        f"file:{workload}", "--num-requests", str(args.num_requests), "--max-concurrency",
                        str(args.max_concurrency), "--output-len", str(args.output_len), "--no-progress",
                        "--output", str(out / f"{name}-bench.json")], check=True, stdout=subprocess.DEVNULL)
        metrics = scrape_metrics(server.url)
    return metrics["vllm:prefix_cache_hits_total"] / metrics["vllm:prefix_cache_queries_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="keep the logs here (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvserve-advise-"))
    out.mkdir(parents=True, exist_ok=True)
    serve_flags = ["--max-model-len", "2048", "--kv-cache-memory", "1"] + (["--model", args.model] if args.model else [])

    serve_and_bench(out, "timestamp-first", serve_flags, workload_file(out / "first.jsonl", args.num_requests, True),
                    args)
    advice = subprocess.run([sys.executable, "-m", "kvserve.cli", "advise", str(out / "timestamp-first.jsonl"),
                             "--json"] + (["--model", args.model] if args.model else []),
                            check=True, capture_output=True, text=True)
    report = json.loads(advice.stdout)
    move = next(fix for fix in report["fixes"] if fix["action"].startswith("move"))
    real = serve_and_bench(out, "timestamp-last", serve_flags, workload_file(out / "last.jsonl", args.num_requests,
                                                                             False), args)
    span = report["dynamic_spans"][0]
    print(f"kvserve serve {' '.join(serve_flags)}; kvserve bench --workload file:... --num-requests "
          f"{args.num_requests} --max-concurrency {args.max_concurrency} --output-len {args.output_len}")
    print(f"found: a {span['kind']} in message {span['message']} ({span['role']}) after {span['anchor']!r}, "
          f"prompts diverge at token {span['token_offset']}")
    print(f"{'hit rate as logged':<34}{report['hit_rate']['logged']:>8.1%}")
    print(f"{'replayed as logged':<34}{report['hit_rate']['replayed']:>8.1%}")
    print(f"{'predicted after the fix (replay)':<34}{move['hit_rate']:>8.1%}")
    print(f"{'real run of the fixed workload':<34}{real:>8.1%}")
    print(f"{'predicted - real':<34}{100 * (move['hit_rate'] - real):>+7.1f} points")
    print(f"logs in {out}")


if __name__ == "__main__":
    main()
