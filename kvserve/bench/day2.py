"""The day-2 verdict of a saved `kvserve bench` run (its --output JSON): P95 TTFT against a target, and the KV
pool's headroom (1 - the peak of `vllm:kv_cache_usage_perc` the run saw) against a floor. The bench.sh that
`kvserve plan --emit-config` writes runs it after the seed's 1,000 requests:

    python -m kvserve.bench.day2 RESULTS.json [--ttft-p95-slo-ms 2000] [--min-pool-headroom 0.1]

Exit status 0 when both targets are met, 1 when either is missed or cannot be known."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def verdict_lines(result: dict, slo_ms: float, min_headroom: float) -> tuple[list[str], bool]:
    ttft = (result["summary"].get("ttft") or {}).get("p95")
    peak = (result.get("server") or {}).get("peak_kv_usage")
    lines = []
    if ttft is None:
        lines.append("P95 TTFT: no request completed")
    else:
        lines.append(f"P95 TTFT: {ttft:,.1f} ms (target <= {slo_ms:,.0f} ms)")
    if peak is None:
        lines.append("KV pool headroom: unknown (no vllm:kv_cache_usage_perc at the target's /metrics: "
                     "point the run at an engine, not the gateway)")
    else:
        lines.append(f"KV pool headroom: {1.0 - peak:.1%} (peak vllm:kv_cache_usage_perc {peak:.1%}; "
                     f"target >= {min_headroom:.0%})")
    ok = ttft is not None and ttft <= slo_ms and peak is not None and 1.0 - peak >= min_headroom
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.bench.day2", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, metavar="RESULTS.json")
    parser.add_argument("--ttft-p95-slo-ms", type=float, default=2000.0)
    parser.add_argument("--min-pool-headroom", type=float, default=0.10)
    args = parser.parse_args(argv)
    lines, ok = verdict_lines(json.loads(args.results.read_text()), args.ttft_p95_slo_ms, args.min_pool_headroom)
    print("\n".join(lines))
    print(f"day-2 test: {'PASS' if ok else 'FAIL'} ({args.results})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
