"""uvicorn with kvserve's shutdown: SIGTERM (or Ctrl-C) stops admitting at once, running requests get
--shutdown-timeout seconds to finish, then the rest are aborted, the engine stops, and the process exits 0.
An engine that dies (a tensor-parallel worker lost) cannot serve again: /health answers 503 at once, and
DEAD_ENGINE_EXIT_DELAY_S later the server stops and exits 1, so a supervisor restarts it.

uvicorn itself closes the listening socket and waits for open connections; what it does not do is tell the
engine to refuse requests that are already inside an open connection, nor exit 0 (after a graceful shutdown it
re-raises the signal to whatever handler was installed before it ran, which by default kills the process).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("kvserve.server")

# Long enough for a readiness probe or the gateway's health check to see the 503 before the port closes.
DEAD_ENGINE_EXIT_DELAY_S = 2.0
EXIT_ENGINE_DEAD = 1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_shutdown_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_shutdown_signal = on_shutdown_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("received %s: admitting no new requests; draining", signal.Signals(sig).name)
        self.on_shutdown_signal()
        super().handle_exit(sig, frame)


def run_server(app: FastAPI, sock: socket.socket, args: argparse.Namespace, engine: AsyncLLMEngine) -> int:
    config = uvicorn.Config(
        app,
        log_config=None,  # keep kvserve's logging format
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = DrainingServer(config, on_shutdown_signal=engine.stop_admitting)
    engine.on_dead.append(lambda exc: _exit_later(server, exc))
    host, port = sock.getsockname()[:2]
    logger.info("kvserve serving %s on http://%s:%d (OpenAI API under /v1, metrics at /metrics)",
                ", ".join(app.state.ctx.settings.served_model_names), host, port)
    _absorb_reraised_signals()
    server.run(sockets=[sock])
    if not server.started:
        return 1
    if engine.failure is not None:
        logger.error("kvserve stopped: the engine died (%s)", engine.failure)
        return EXIT_ENGINE_DEAD
    logger.info("kvserve stopped")
    return 0


def _exit_later(server: uvicorn.Server, exc: BaseException) -> None:
    logger.error("the engine is dead (%s); the server exits in %.0f s", exc, DEAD_ENGINE_EXIT_DELAY_S)
    timer = threading.Timer(DEAD_ENGINE_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))
    timer.daemon = True
    timer.start()


def _absorb_reraised_signals() -> None:
    # uvicorn restores the previous handlers and re-raises the signal it shut down for; with these handlers that
    # re-raise is a no-op and `kvserve serve` exits 0 after a graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
