"""The benchmark suite's flags, shared by `python benchmarks/run_all.py` and `kvserve bench suite` (the suite
script lives in the repository's benchmarks/, not in the package)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_suite_arguments(parser: argparse.ArgumentParser, default_out: Path | None) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few requests per part")
    parser.add_argument("--model", default=None, help="kvserve's --model (default: the SmolLM2-135M demo GGUF)")
    parser.add_argument("--llama-server", default=None, metavar="PATH", help="default: llama-server on PATH")
    parser.add_argument("--llama-model", default=None, metavar="GGUF",
                        help="the GGUF llama-server serves (default: --model if a .gguf, else the demo GGUF)")
    parser.add_argument("--skip-offline", action="store_true", help="no offline throughput vs transformers")
    parser.add_argument("--skip-llama-server", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=default_out,
                        help="RESULTS.md and results/ go here (default: the repository's benchmarks/)")
