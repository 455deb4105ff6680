"""`kvserve serve`: the OpenAI-compatible server, with vLLM's flags, so a vLLM command line works as written.

Start-up failures (a feature not built yet, a model that cannot be loaded, a busy port) end with one line on
stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.args import add_engine_arguments
    from kvserve.server.config_file import track_explicit_options
    from kvserve.server.settings import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES

    group = parser.add_argument_group("server")
    group.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="YAML file with the same keys as these flags (max-model-len: 4096); the command line wins")
    group.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names clients use in `model` (default: --model as given); the first labels the metrics")
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests with 503 + Retry-After while this many wait for a slot "
                            "(default: no limit)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="largest accepted request body; bigger ones get 413")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let running requests finish before aborting them (0: abort now)")
    group.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                       help="auto: the model's generation_config.json sets default temperature/top_p/top_k/min_p/"
                            "repetition_penalty; vllm: ignore it")
    group.add_argument("--log-requests-file", default=None, metavar="PATH.jsonl",
                       help="append one JSON line per request (prompt token ids, rendered prompt, messages, cached "
                            "tokens) for `kvserve advise`; it holds every prompt and completion in full")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / KV usage line")
    group.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats lines")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_engine_arguments(parser)
    track_explicit_options(parser)
    parser.set_defaults(_serve_parser=parser)


def run(args: argparse.Namespace) -> int:
    from kvserve.server.startup import StartupError, serve

    try:
        return serve(args)
    except StartupError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return exc.exit_code
