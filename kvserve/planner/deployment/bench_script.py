"""bench.sh: the seed's day-2 test against the deployed endpoint, rerun whenever the model, its flags or the
instance change: 1,000 requests sharing a 2,048-token system prompt, 32 at a time, through `kvserve bench`;
it passes when P95 TTFT stays under the alert's threshold and the KV pool keeps headroom (peak
`vllm:kv_cache_usage_perc` below the alert's 90%), i.e. when that load would not page anyone."""

from __future__ import annotations

from kvserve.planner.plan import Plan

NUM_REQUESTS = 1000
SYSTEM_PROMPT_LEN = 2048
USER_LEN = 32
OUTPUT_LEN = 64
MAX_CONCURRENCY = 32
WARMUP = 4
# The same thresholds as deploy/prometheus/kvserve-alerts.yaml (KvserveTTFTHigh, KvserveKVCacheNearlyFull).
TTFT_P95_SLO_MS = 2000
MIN_POOL_HEADROOM = 0.10

_TEMPLATE = """#!/usr/bin/env bash
{header}
#
# The day-2 test: {num_requests} requests sharing a {system_len}-token system prompt ({user_len}-token questions,
# {output_len}-token answers), {concurrency} at a time, then P95 TTFT and the KV pool's headroom (1 - the peak of
# vllm:kv_cache_usage_perc). Rerun it whenever the model, its flags or the instance change. {concurrency} at a time
# is the seed's figure whatever --max-num-seqs is: requests beyond it wait, and the wait shows in TTFT.
#
#   ./bench.sh [URL]    URL: one engine (default http://127.0.0.1:8000, e.g. after
#                       kubectl port-forward pod/kvserve-engine-0 8000:8000); the pool headroom comes from its
#                       /metrics (a gateway's /metrics has no vllm:kv_cache_usage_perc: TTFT only)
# Environment: KVSERVE_API_KEY (the server's --api-key), NUM_REQUESTS, OUTPUT (the results' JSON),
# TTFT_P95_SLO_MS ({ttft_slo}), MIN_POOL_HEADROOM ({headroom}). Exit status 1 when either target is missed
# (python -m kvserve.bench.day2 reads the results; PYTHON: an interpreter with kvserve, default python3).
set -euo pipefail
URL=${{1:-${{KVSERVE_URL:-http://127.0.0.1:8000}}}}
OUTPUT=${{OUTPUT:-day2-$(date +%Y%m%d-%H%M%S).json}}
api_key=()
if [ -n "${{KVSERVE_API_KEY:-}}" ]; then api_key=(--api-key "$KVSERVE_API_KEY"); fi

kvserve bench --base-url "$URL" "${{api_key[@]}}" --label day2 --output "$OUTPUT" --no-progress \\
    --workload shared-prefix --system-prompt-len {system_len} --user-len {user_len} --output-len {output_len} \\
    --num-requests "${{NUM_REQUESTS:-{num_requests}}}" --max-concurrency {concurrency} --warmup {warmup} --ignore-eos

"${{PYTHON:-python3}}" -m kvserve.bench.day2 "$OUTPUT" --ttft-p95-slo-ms "${{TTFT_P95_SLO_MS:-{ttft_slo}}}" \\
    --min-pool-headroom "${{MIN_POOL_HEADROOM:-{headroom}}}"
"""


def bench_script(plan: Plan, header: list[str]) -> str:
    output_len = OUTPUT_LEN
    # The prompt and its answer must fit --max-model-len (kvserve bench refuses a workload that cannot).
    system_len = max(16, min(SYSTEM_PROMPT_LEN, plan.max_model_len - USER_LEN - output_len - 64))
    return _TEMPLATE.format(
        header="\n".join(f"# {line}" for line in header), num_requests=NUM_REQUESTS, system_len=system_len,
        user_len=USER_LEN, output_len=output_len, concurrency=MAX_CONCURRENCY,
        warmup=WARMUP, ttft_slo=TTFT_P95_SLO_MS, headroom=MIN_POOL_HEADROOM,
    )
