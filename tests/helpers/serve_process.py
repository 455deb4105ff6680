"""`kvserve serve` as a real subprocess (the benchmark suite's ServerProcess: a free port, waited for, SIGTERM at
the end of the `with` block), so a test sees what an operator sees, shutdown included."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from run_all import ServerProcess, ServerSpec  # noqa: E402

START_TIMEOUT_S = 300.0  # generous: a loaded 2-core machine; ready is polled, not waited out


def kvserve_serve(output_path: Path, *flags: str) -> ServerProcess:
    """Use as `with kvserve_serve(path, "--model", ...) as server:`; the server's output goes to `output_path`."""
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
               "--disable-log-stats", "--disable-uvicorn-access-log", *flags]
    return ServerProcess(ServerSpec("kvserve", "kvserve serve", command, " ".join(flags)), output_path,
                         START_TIMEOUT_S)


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
