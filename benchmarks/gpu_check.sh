#!/usr/bin/env bash
# The GPU check: one run on a lent NVIDIA GPU (an H200, 8 minutes at most) that tests and measures the CUDA path.
#
#     bash benchmarks/gpu_check.sh [--cpu-dry-run]
#
# Steps, each under its own time limit (a step that fails or runs out of time is recorded and the next one runs;
# the script exits 1 at the end if any failed):
#   wheels        installs the .whl/*.whl (benchmarks/gpu_wheels.sh) the image lacks, into /tmp/site
#   imports       the engine, the loader and the Triton kernels import; on a GPU run, torch sees CUDA
#   kernel_tests  pytest tests/model/test_triton_kernels.py: the Triton kernels on CUDA tensors
#   cuda_tests    pytest tests/engine/test_cuda_parity.py: the engine on CUDA against transformers
#                 (dry run: both only collected; the suite runs the kernels' tests under TRITON_INTERPRET=1)
#   bandwidth     benchmarks/gpu_decode_bandwidth.py: decode attention GB/s per KV dtype against the HBM peak
#   offline       benchmarks/gpu_offline.py: output tokens/s, prefix caching x CUDA graphs, Triton backend;
#                 the pool's planned memory against the observed peak
#
# Results go to $OUT (default: a new temp folder, printed at the end): gpu_check.log (everything printed),
# steps.json (each step's status and time), pytest_kernels.xml and pytest_cuda.xml (GPU run),
# decode_bandwidth.json, offline.json.
# --cpu-dry-run: the same steps on the CPU (CUDA hidden, TRITON_INTERPRET=1) with tiny shapes, in under a
# minute: what tests/bench/test_gpu_check_script.py runs. PYTHON overrides the interpreter (default python3),
# GPU_CHECK_BUDGET_S the whole run's seconds (470 on a GPU; later steps get what earlier ones left).
set -u -o pipefail

usage() { sed -n '2,/^$/p' "$0" | sed -e 's/^# \{0,1\}//' -e '/^set /d'; }

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --cpu-dry-run) DRY_RUN=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; usage >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvserve-gpu-check.XXXXXX")}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: > "$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvserve-gpu-check-work.XXXXXX")  # scratch outside $OUT (its files come back)
trap 'rm -rf "$WORK"' EXIT
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if (( DRY_RUN )); then
    MODE=cpu-dry-run
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    BUDGET_S=${GPU_CHECK_BUDGET_S:-200}
    LIMIT_KERNEL_TESTS=30 LIMIT_CUDA_TESTS=30 LIMIT_BANDWIDTH=60 LIMIT_OFFLINE=120
    DRY_FLAG=(--dry-run)
    MODEL_DIR="$WORK/tiny-llama-random"
else
    MODE=gpu
    BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
    # About 450 s of steps under an 8-minute lease (the offline step starts 4 engines on a 1B model); each
    # limit is capped by what the earlier steps left of BUDGET_S.
    LIMIT_KERNEL_TESTS=90 LIMIT_CUDA_TESTS=90 LIMIT_BANDWIDTH=70 LIMIT_OFFLINE=200
    DRY_FLAG=()
    MODEL_DIR=/tmp/kvserve-llama-3.2-1b-random
fi
START=$SECONDS
STEPS=()  # "name status seconds exit_status", one per step

log() { echo "$*" | tee -a "$LOG"; }

record() {  # name status seconds exit_status
    STEPS+=("$1 $2 $3 $4")
    log "=== step $1: $2 (exit $4, $3 s)"
}

run_step() {  # name limit_s command...: runs it under what is left of the budget, output to the log and stdout
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET_S - (SECONDS - START) ))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        record "$name" skipped 0 -1
        return
    fi
    local shown="$*"
    shown=${shown//$'\n'/ }
    log "=== step $name (limit ${limit} s): ${shown:0:240}"
    local started=$SECONDS
    # SIGINT first: pytest then prints its summary and writes its XML, the scripts keep the JSON written so far.
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]} outcome=passed
    if (( status == 124 || status == 137 )); then
        outcome=timed_out
    elif (( status != 0 )); then
        outcome=failed
    fi
    record "$name" "$outcome" $(( SECONDS - started )) "$status"
}

header() {
    log "kvserve gpu_check ($MODE) $(date -u +%Y-%m-%dT%H:%M:%SZ) repo=$REPO out=$OUT budget=${BUDGET_S}s"
    log "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown) $(git -C "$REPO" status --porcelain 2>/dev/null | wc -l) changed files"
    if command -v nvidia-smi > /dev/null; then
        timeout 30 nvidia-smi 2>&1 | tee -a "$LOG"
    else
        log "nvidia-smi: not found"
    fi
    timeout 60 "$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import os, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
for name in ("triton", "transformers", "numpy", "tokenizers", "safetensors"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
          f"{props.multi_processor_count} SMs, {torch.cuda.device_count()} device(s)")
else:
    print("GPU: none (torch.cuda.is_available() is False)")
EOF
}

install_wheels() {  # in this shell, so the PYTHONPATH it sets reaches the later steps
    local started=$SECONDS wheels=("$REPO"/.whl/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        log "wheels: no .whl/ (benchmarks/gpu_wheels.sh): the image's packages only"
        record wheels passed 0 0
        return
    fi
    # Only the distributions the image lacks: a wheel on PYTHONPATH would shadow the image's own version.
    local missing
    missing=$("$PY" - "${wheels[@]}" <<'EOF'
import sys
from importlib import metadata

for path in sys.argv[1:]:
    try:
        metadata.version(path.rsplit("/", 1)[-1].split("-")[0])
    except metadata.PackageNotFoundError:
        print(path)
EOF
    )
    if [[ -z "$missing" ]]; then
        log "wheels: every one of ${#wheels[@]} already installed"
        record wheels passed $(( SECONDS - started )) 0
        return
    fi
    local site=${KVSERVE_WHEEL_SITE:-/tmp/site}
    log "wheels: installing into $site: $(echo "$missing" | xargs -n1 basename | tr '\n' ' ')"
    local status=0 wheel
    if "$PY" -m pip --version > /dev/null 2>&1; then
        # shellcheck disable=SC2086  # one path per line, none with spaces (the repo's own .whl/)
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" $missing \
            2>&1 | tee -a "$LOG"
        status=${PIPESTATUS[0]}
    else  # no pip in the image: a wheel is a zip of the files site-packages would hold
        log "wheels: no pip here, unpacking them instead"
        for wheel in $missing; do
            "$PY" -m zipfile -e "$wheel" "$site" 2>&1 | tee -a "$LOG" || status=1
        done
    fi
    export PYTHONPATH="$site:$PYTHONPATH"
    record wheels "$( (( status == 0 )) && echo passed || echo failed)" $(( SECONDS - started )) "$status"
}

# The engine, the loader and the Triton kernels import; a GPU run also needs torch to see the GPU.
cat > "$WORK/imports_check.py" <<'EOF'
import sys

import torch

from kvserve import LLM  # noqa: F401
import kvserve.engine.llm_engine  # noqa: F401
import kvserve.model.loader  # noqa: F401
from kvserve.model.triton_kernels import decode_attention  # noqa: F401

if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: the GPU steps would measure the CPU")
print("imports: kvserve.LLM, the engine, the loader and the Triton decode kernel import")
EOF

tests_command() {  # xml_name test_file...: sets TESTS_COMMAND (timeout runs commands, not shell functions)
    local xml=$1
    shift
    if (( DRY_RUN )); then
        TESTS_COMMAND=("$PY" -m pytest -q -p no:cacheprovider --collect-only "$@")
        return
    fi
    # -v: a line per test as it ends, so a run cut off by its limit still shows how far it got.
    TESTS_COMMAND=("$PY" -m pytest -v -p no:cacheprovider -rfEs --durations=10 --junitxml="$OUT/$xml")
    if [[ " $* " == *" tests/engine/test_cuda_parity.py "* ]] && ! "$PY" -c "import fastapi, uvicorn, openai" 2> /dev/null; then
        log "tests: fastapi/uvicorn/openai missing here: the server test is deselected"
        TESTS_COMMAND+=(--deselect
            tests/engine/test_cuda_parity.py::test_server_on_cuda_streams_to_the_openai_client_and_reports_gpu_memory)
    fi
    TESTS_COMMAND+=("$@")
}

write_steps_json() {
    "$PY" - "$OUT/steps.json" "$MODE" $(( SECONDS - START )) "${STEPS[@]}" <<'EOF'
import json
import sys

path, mode, seconds, *steps = sys.argv[1:]
entries = []
for line in steps:
    name, status, step_seconds, exit_status = line.split()
    entries.append({"name": name, "status": status, "seconds": int(step_seconds), "exit_status": int(exit_status)})
report = {"mode": mode, "seconds": int(seconds), "passed": all(e["status"] == "passed" for e in entries),
          "steps": entries}
with open(path, "w") as handle:
    json.dump(report, handle, indent=2)
    handle.write("\n")
EOF
}

header
install_wheels
run_step imports 60 "$PY" "$WORK/imports_check.py" "$MODE"
tests_command pytest_kernels.xml tests/model/test_triton_kernels.py
run_step kernel_tests "$LIMIT_KERNEL_TESTS" "${TESTS_COMMAND[@]}"
tests_command pytest_cuda.xml tests/engine/test_cuda_parity.py
run_step cuda_tests "$LIMIT_CUDA_TESTS" "${TESTS_COMMAND[@]}"
run_step bandwidth "$LIMIT_BANDWIDTH" "$PY" benchmarks/gpu_decode_bandwidth.py --out "$OUT/decode_bandwidth.json" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}
run_step offline "$LIMIT_OFFLINE" "$PY" benchmarks/gpu_offline.py --out "$OUT/offline.json" --model-dir "$MODEL_DIR" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"}
write_steps_json

log ""
log "step          status     seconds"
failed=0
for line in "${STEPS[@]}"; do
    read -r name status seconds _ <<< "$line"
    log "$(printf '%-13s %-10s %7s' "$name" "$status" "$seconds")"
    [[ "$status" == passed ]] || failed=1
done
log "total $(( SECONDS - START )) s; results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $failed
