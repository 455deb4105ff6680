"""From parsed `kvserve serve` arguments to a running server: config file, engine config, port, model, uvicorn.

The order fails fast and cheaply: flags and config file first, then the port (a busy port should not cost a
model load), then the model.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from kvserve.server.settings import API_KEY_ENV

EXIT_USAGE = 2
EXIT_STARTUP_FAILED = 1


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_STARTUP_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def serve(args: argparse.Namespace) -> int:
    apply_config(args)
    configure_logging(args.uvicorn_log_level)
    validate_server_args(args)
    engine_config = build_engine_config(args)
    sock = bind_socket(args.host, args.port)
    try:
        async_engine = start_engine(engine_config, args.max_waiting_requests)
        settings = build_settings(args, async_engine)
        from kvserve.server.app import build_app
        from kvserve.server.runner import run_server

        app = build_app(async_engine, settings)
        return run_server(app, sock, args, async_engine)
    finally:
        sock.close()


def apply_config(args: argparse.Namespace) -> None:
    if not args.config:
        return
    from kvserve.server.config_file import ConfigFileError, apply_config_file

    try:
        apply_config_file(args._serve_parser, args, args.config)
    except ConfigFileError as exc:
        raise StartupError(str(exc), EXIT_USAGE) from None


def validate_server_args(args: argparse.Namespace) -> None:
    checks = [
        (0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}"),
        (args.max_waiting_requests is None or args.max_waiting_requests >= 0,
         f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}"),
        (args.max_request_bytes > 0, f"--max-request-bytes must be > 0, got {args.max_request_bytes}"),
        (args.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"),
        (args.log_stats_interval > 0, f"--log-stats-interval must be > 0, got {args.log_stats_interval}"),
    ]
    for ok, message in checks:
        if not ok:
            raise StartupError(message, EXIT_USAGE)
    check_request_log(args.log_requests_file)


def check_request_log(path: str | None) -> None:
    if path is None:
        return
    from kvserve.server.request_log import check_log_path

    try:
        check_log_path(path)
    except OSError as exc:
        raise StartupError(f"--log-requests-file {path}: cannot open it for writing: {exc.strerror or exc}",
                           EXIT_USAGE) from None


def build_engine_config(args: argparse.Namespace):
    from kvserve.engine.startup import EngineStartError, engine_config_from_flags

    try:
        config = engine_config_from_flags(args)
    except EngineStartError as exc:
        raise StartupError(str(exc), EXIT_USAGE) from None
    config.scheduler.max_waiting_requests = args.max_waiting_requests
    return config


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def start_engine(config, max_waiting_requests: int | None):
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.startup import EngineStartError
    from kvserve.engine.startup import start_engine as start_llm_engine

    try:
        # Built in the thread that steps it: every torch op on one thread (async_engine.py says why).
        return AsyncLLMEngine.build_in_thread(lambda: start_llm_engine(config), max_waiting_requests)
    except EngineStartError as exc:
        raise StartupError(str(exc), EXIT_USAGE if exc.usage else EXIT_STARTUP_FAILED) from None


def build_settings(args: argparse.Namespace, async_engine):
    from kvserve.server.settings import ServerSettings

    loaded = async_engine.engine.loaded
    names = args.served_model_name or [args.model or loaded.name]
    return ServerSettings(
        served_model_names=list(names),
        api_key=resolve_api_key(args),
        max_request_bytes=args.max_request_bytes,
        use_generation_config=args.generation_config == "auto",
        log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
        root=str(loaded.path),
        log_requests_file=args.log_requests_file,
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def configure_logging(level: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("uvicorn").setLevel(level.upper() if level != "trace" else 5)
