"""A real `kvserve serve` subprocess on a free port of 127.0.0.1, for the deploy tests; always stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
from ports import free_port



def wait_ready(url: str, process: subprocess.Popen, log_path: str, timeout_s: float = 120.0) -> None:
    """Until GET url answers 200; fails with the process's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[0]} exited {process.returncode}:\n{open(log_path).read()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not answer:\n{open(log_path).read()[-3000:]}"
        time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running_kvserve(args: list[str]) -> Iterator[str]:
    """`kvserve serve ARGS --host 127.0.0.1 --port P`; yields its URL."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port),
             "--disable-log-stats"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", process, log.name)
        yield url
    finally:
        stop(process)
        os.unlink(log.name)
