"""Rank 0's handle on one tensor-parallel worker process.

A worker is a fresh interpreter running `python -m kvserve.engine.tp_worker`: never a fork of a process holding
threads and a device context, and never a re-run of the main program (multiprocessing's spawn re-imports
`__main__`, which fails for standard input and re-runs a script without a main guard). It gets a message pipe,
a heartbeat pipe and its own session (a terminal's Ctrl-C or Ctrl-Z reaches rank 0 only; rank 0 decides the
workers' fate). Its stderr is forwarded to rank 0's, and its last lines are kept for the failure message.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import kvserve

STDERR_LINES_KEPT = 10
STDERR_DRAIN_S = 2.0  # a dead worker's last lines are still in the pipe when its exit is noticed


def _worker_command(conn_fd: int, heartbeat_fd: int) -> list[str]:
    # -P (3.11+): the current folder does not go on sys.path, so a stray `kvserve` there cannot shadow ours.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "kvserve.engine.tp_worker", str(conn_fd), str(heartbeat_fd)]


def _worker_env() -> dict[str, str]:
    """This process's environment, with the kvserve rank 0 runs first on the path (whatever put it on ours)."""
    root = str(Path(kvserve.__file__).resolve().parent.parent)
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class WorkerProcess:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conn, child_conn = multiprocessing.Pipe()
        self.heartbeat_fd, child_heartbeat = os.pipe()
        self.process = subprocess.Popen(
            _worker_command(child_conn.fileno(), child_heartbeat), pass_fds=(child_conn.fileno(), child_heartbeat),
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_worker_env(), start_new_session=True,
        )
        child_conn.close()
        os.close(child_heartbeat)
        self.pid = self.process.pid
        self.last_heartbeat = time.monotonic()  # from its start: a worker that never beats is silent too
        self.heartbeat_open = True
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_LINES_KEPT)
        self._stderr_reader = threading.Thread(target=self._forward_stderr, name=f"kvserve-tp-rank{rank}-stderr",
                                               daemon=True)
        self._stderr_reader.start()

    # ---- liveness ------------------------------------------------------------------------------------------

    def exit_code(self) -> int | None:
        return self.process.poll()

    def exit_code_within(self, seconds: float) -> int | None:
        """Its exit code, waiting up to `seconds` for one: a worker whose pipe just closed is usually exiting, and
        its status (code, stderr) says more than "stopped answering"."""
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def read_heartbeat(self) -> None:
        beats = os.read(self.heartbeat_fd, 4096)
        if beats:
            self.last_heartbeat = time.monotonic()
        else:
            self.heartbeat_open = False  # it closed its end: it is exiting

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heartbeat

    def describe_state(self) -> str:
        """The kernel's word for a live process ("T (stopped)", "R (running)"), where /proc tells it."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return "unknown"
        return next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")),
                    "unknown")

    # ---- stderr --------------------------------------------------------------------------------------------

    def _forward_stderr(self) -> None:
        for raw in self.process.stderr:
            line = raw.decode(errors="replace")
            self._stderr_tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our own stderr is closed (interpreter exit): the tail is still kept

    def stderr_tail(self) -> list[str]:
        if self.exit_code() is not None:
            self._stderr_reader.join(timeout=STDERR_DRAIN_S)
        return list(self._stderr_tail)

    # ---- the end -------------------------------------------------------------------------------------------

    def kill(self) -> None:
        if self.exit_code() is None:
            self.process.kill()

    def stop(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for it to exit (it was asked to), then kills it."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)

    def close_pipes(self) -> None:
        self.conn.close()
        os.close(self.heartbeat_fd)
        self._stderr_reader.join(timeout=STDERR_DRAIN_S)
        if not self._stderr_reader.is_alive():  # else a child of its own still holds the pipe: leave it
            self.process.stderr.close()
