"""A worker's heartbeat: a byte down a pipe to rank 0 every HEARTBEAT_INTERVAL_S, from a thread of its own.

A stopped worker (SIGSTOP, a frozen node) keeps its connections open, so its peers' collectives would wait out
their whole timeout; its silence on this pipe is what rank 0 notices within seconds. A write that fails means
rank 0 has gone, however it died: the worker exits instead of living on as an orphan.
"""

from __future__ import annotations

import os
import threading
import time

HEARTBEAT_INTERVAL_S = 0.5


def start_heartbeat(fd: int) -> None:
    os.set_blocking(fd, False)  # a full pipe (rank 0 busy or stopped) must not block the beat: beats pile up
    threading.Thread(target=_beat, args=(fd,), name="kvserve-tp-heartbeat", daemon=True).start()


def _beat(fd: int) -> None:
    while True:
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass  # rank 0 has a pipe full of beats still to read
        except OSError:
            os._exit(1)  # the pipe is closed: rank 0 is gone
        time.sleep(HEARTBEAT_INTERVAL_S)
