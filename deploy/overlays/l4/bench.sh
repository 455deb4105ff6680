#!/usr/bin/env bash
# Written by: kvserve plan --model Qwen/Qwen2.5-7B-Instruct --gpu L4 --max-model-len 8192 --max-num-seqs 8 --kv-cache-dtype fp8 --emit-config DIR
# The plan: FITS: 8 × 8,192 tokens (1.75 GiB) fit in the 4.98 GiB pool; no preemption even at full load
#
# The day-2 test: 1000 requests sharing a 2048-token system prompt (32-token questions,
# 64-token answers), 32 at a time, then P95 TTFT and the KV pool's headroom (1 - the peak of
# vllm:kv_cache_usage_perc). Rerun it whenever the model, its flags or the instance change. 32 at a time
# is the seed's figure whatever --max-num-seqs is: requests beyond it wait, and the wait shows in TTFT.
#
#   ./bench.sh [URL]    URL: one engine (default http://127.0.0.1:8000, e.g. after
#                       kubectl port-forward pod/kvserve-engine-0 8000:8000); the pool headroom comes from its
#                       /metrics (a gateway's /metrics has no vllm:kv_cache_usage_perc: TTFT only)
# Environment: KVSERVE_API_KEY (the server's --api-key), NUM_REQUESTS, OUTPUT (the results' JSON),
# TTFT_P95_SLO_MS (2000), MIN_POOL_HEADROOM (0.1). Exit status 1 when either target is missed
# (python -m kvserve.bench.day2 reads the results; PYTHON: an interpreter with kvserve, default python3).
set -euo pipefail
URL=${1:-${KVSERVE_URL:-http://127.0.0.1:8000}}
OUTPUT=${OUTPUT:-day2-$(date +%Y%m%d-%H%M%S).json}
api_key=()
if [ -n "${KVSERVE_API_KEY:-}" ]; then api_key=(--api-key "$KVSERVE_API_KEY"); fi

kvserve bench --base-url "$URL" "${api_key[@]}" --label day2 --output "$OUTPUT" --no-progress \
    --workload shared-prefix --system-prompt-len 2048 --user-len 32 --output-len 64 \
    --num-requests "${NUM_REQUESTS:-1000}" --max-concurrency 32 --warmup 4 --ignore-eos

"${PYTHON:-python3}" -m kvserve.bench.day2 "$OUTPUT" --ttft-p95-slo-ms "${TTFT_P95_SLO_MS:-2000}" \
    --min-pool-headroom "${MIN_POOL_HEADROOM:-0.1}"
