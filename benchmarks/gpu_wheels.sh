#!/usr/bin/env bash
# Downloads, here (where pip reaches the package index), the wheels that kvserve's offline engine path needs and
# the lent GPU machine's image lacks, into .whl/ at the repository root; benchmarks/gpu_check.sh installs them
# there (no network on that machine). Run before handing the working tree to the GPU machine:
#
#     bash benchmarks/gpu_wheels.sh            # then carry .whl with the tree (it is git-ignored)
#
# What the engine imports beyond the standard library (python -X importtime -c "from kvserve import LLM", and
# kvserve.engine.llm_engine / kvserve.model.loader): torch, numpy, safetensors, tokenizers, jinja2, tqdm, pyyaml,
# xxhash (all in the GPU image) and gguf (kvserve/model/quant_weight.py and gguf_file.py import it at module
# level; its own imports are numpy, pyyaml and, lazily, requests, which only its downloader uses). gguf is
# pure Python (py3-none-any), so the cp312 manylinux request below matches it as it would a compiled wheel.
# The server stack (fastapi, uvicorn, pydantic, openai) is not fetched: the offline engine never imports it,
# and gpu_check.sh leaves out the one CUDA test that starts a server when it is missing.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS="$REPO/.whl"
# NAME==VERSION: the versions this repository's tests run against (pip list in the development venv).
ENGINE_WHEELS=(gguf==0.19.0)

mkdir -p "$WHEELS"
for requirement in "${ENGINE_WHEELS[@]}"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "$requirement"
done

# Ignored by git (a local exclude, so nothing tracked changes), hence not copied unless carried: the device
# run's carry list must name .whl.
exclude="$(git -C "$REPO" rev-parse --git-path info/exclude)"
case "$exclude" in /*) ;; *) exclude="$REPO/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

ls -l "$WHEELS"
du -sh "$WHEELS"
