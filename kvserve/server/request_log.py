"""`kvserve serve --log-requests-file PATH`: one JSON line per API request, the input of `kvserve advise`.

A line holds what a replay of the prefix cache needs to be exact: the prompt token ids the engine saw (after
the chat template and tokenization), the rendered prompt text, the request body as sent (messages or prompt),
the cache salt, the usage with cached tokens, the generated token ids (they fill blocks too), and the pool's
geometry (block size, number of blocks, hash algorithm).

PRIVACY: the file holds every prompt and completion in full. Treat it like the traffic itself: keep it off
shared disks, rotate and delete it, and turn the flag on for a diagnosis rather than permanently.

The request path pays only for queueing a reference: JSON encoding and file writes happen in a writer thread,
which flushes whenever it has drained its queue and once more at shutdown. A file it creates is 0600, and
each folder it creates on the way to it 0700.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvserve.engine.outputs import RequestOutput
from kvserve.private_paths import make_private_folders
from kvserve.server.bounded_queue import BoundedQueue
from kvserve.server.log_throttle import ThrottledWarning
from kvserve.server.prompts import Prompt
from kvserve.server.stream_state import final_usage

LOG_FORMAT_VERSION = 1
WRITE_BUFFER_BYTES = 1 << 20
# Lines waiting for the writer thread; beyond either bound new lines are dropped (and counted).
MAX_QUEUED_ENTRIES = 10_000
MAX_QUEUED_BYTES = 256 << 20
BYTES_PER_QUEUED_TOKEN = 40  # a list slot and an int object
logger = logging.getLogger("kvserve.server")


@dataclass(slots=True)
class PoolGeometry:
    """What a replay needs to model the engine's prefix cache."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    hash_algo: str
    model_path: str | None = None  # where `kvserve advise` finds the tokenizer and chat template

    def as_dict(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": self.num_blocks,
                "enable_prefix_caching": self.enable_prefix_caching, "hash_algo": self.hash_algo,
                "model_path": self.model_path}


@dataclass(slots=True)
class LoggedRequest:
    """References to one API request's parts, taken on the event loop; encoded later by the writer thread."""

    time: float  # unix seconds when the request was handed to the engine
    request_id: str
    endpoint: str
    model: str
    body: BaseModel
    prompts: list[Prompt]
    n: int
    latest_outputs: list[RequestOutput | None]
    finished_time: float = 0.0  # set when the job closes

    def as_json(self, geometry: PoolGeometry) -> dict[str, Any]:
        outputs = self.latest_outputs
        usage = final_usage([output for output in outputs if output is not None], self.n).as_dict()
        return {
            "version": LOG_FORMAT_VERSION,
            "time": self.time,
            "duration_s": round(self.finished_time - self.time, 6),
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "cache_salt": getattr(self.body, "cache_salt", None),
            "request": self.body.model_dump(mode="json", exclude_unset=True),
            "prompts": [_prompt_json(prompt, output) for prompt, output in zip(self.prompts, outputs)],
            "usage": usage,
            "finished": all(output is not None and output.finished for output in outputs),
            "cache": geometry.as_dict(),
        }


def _prompt_json(prompt: Prompt, output: RequestOutput | None) -> dict[str, Any]:
    return {
        "token_ids": prompt.token_ids,
        "text": prompt.text,
        "cached_tokens": output.num_cached_tokens if output is not None else None,
        "output_token_ids": [choice.token_ids for choice in output.outputs] if output is not None else [],
        "finish_reasons": [choice.finish_reason for choice in output.outputs] if output is not None else [],
    }


def check_log_path(path: str) -> None:
    """Fails at start-up, before the model loads, if the file cannot be opened for appending."""
    open_private_append(Path(path).expanduser()).close()


def open_private_append(path: Path):
    """Opens for appending; a file this creates is the owner's alone (0600): it holds every prompt and answer."""
    make_private_folders(path.parent)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(descriptor, "a", encoding="utf-8", buffering=WRITE_BUFFER_BYTES)


def approximate_bytes(entry: LoggedRequest) -> int:
    """What a queued entry keeps alive: its token lists and texts (the body repeats the prompt's text)."""
    outputs = [choice for output in entry.latest_outputs if output is not None for choice in output.outputs]
    num_tokens = sum(len(prompt.token_ids) for prompt in entry.prompts) + sum(len(c.token_ids) for c in outputs)
    num_chars = sum(len(prompt.text or "") for prompt in entry.prompts) + sum(len(c.text) for c in outputs)
    return BYTES_PER_QUEUED_TOKEN * num_tokens + 2 * num_chars


_STOP = object()


class RequestLog:
    """Appends LoggedRequest lines to a file from a writer thread.

    The queue is bounded: when the writer falls behind (a slow or stalled disk), new lines are dropped and
    counted rather than kept. A write error drops the lines in flight, is counted, and the file is reopened for
    the next line, so the writer thread outlives a full disk.
    """

    def __init__(self, path: str, geometry: PoolGeometry, max_queued_entries: int = MAX_QUEUED_ENTRIES,
                 max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.path = Path(path).expanduser()
        self.geometry = geometry
        self.num_dropped = 0  # lines not queued because the queue was full
        self.num_write_errors = 0  # failed writes; each loses the lines buffered at the time
        self._file = open_private_append(self.path)
        self._queue = BoundedQueue(max_queued_entries, max_queued_bytes)
        self._closed = False
        self._drop_warning = ThrottledWarning(logger)
        self._error_warning = ThrottledWarning(logger)
        self._thread = threading.Thread(target=self._write_forever, name="kvserve-request-log", daemon=True)
        self._thread.start()

    def record(self, entry: LoggedRequest) -> None:
        if self._closed:  # a stream that ended after shutdown began; the file is already closed
            logger.debug("request log closed; %s not logged", entry.request_id)
            return
        if not self._queue.put(entry, approximate_bytes(entry)):
            self.num_dropped += 1
            self._drop_warning.warn("request log %s is behind its writes: request %s not logged (%d dropped so far)",
                                    self.path, entry.request_id, self.num_dropped)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put_always(_STOP)
        self._thread.join(timeout=30)

    @property
    def writer_alive(self) -> bool:
        return self._thread.is_alive()

    def _write_forever(self) -> None:
        try:
            while True:
                entry = self._queue.get()
                if entry is _STOP:
                    return
                self._write(entry)
                if self._queue.empty():
                    self._guarded(self._flush)
        finally:
            self._guarded(self._flush)
            self._close_file()

    def _write(self, entry: LoggedRequest) -> None:
        try:
            line = json.dumps(entry.as_json(self.geometry), ensure_ascii=False, separators=(",", ":"))
        except Exception:  # one odd request must not stop the log
            logger.exception("could not log request %s", entry.request_id)
            return
        self._guarded(lambda: self._open_file().write(line + "\n"))

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _guarded(self, operation) -> None:
        """Runs a file operation; an OSError is counted and reported, and the file closed to be reopened later."""
        try:
            operation()
        except OSError as exc:
            self.num_write_errors += 1
            self._error_warning.warn("request log %s: write failed, lines lost (%d write errors so far): %s",
                                     self.path, self.num_write_errors, exc, exc_info=exc)
            self._close_file()

    def _open_file(self):
        if self._file is None:
            self._file = open_private_append(self.path)
        return self._file

    def _close_file(self) -> None:
        """Closes even when the final flush fails: the buffered lines are then dropped, the descriptor freed."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()
        except OSError:
            pass


def pool_geometry(kv_cache, model_path: str | None) -> PoolGeometry:
    return PoolGeometry(kv_cache.block_size, kv_cache.num_blocks, kv_cache.enable_prefix_caching,
                        kv_cache.hasher.hash_algo, model_path)


def log_request(request_log: RequestLog | None, job, endpoint: str, request_id: str, model: str,
                body: BaseModel) -> None:
    """Arranges for the job's line to be written when it closes (finished, failed or aborted)."""
    if request_log is None:
        return
    entry = LoggedRequest(time.time(), request_id, endpoint, model, body, job.prompts, body.n, job.latest_outputs)

    def write() -> None:
        entry.finished_time = time.time()
        request_log.record(entry)

    job.on_closed = write
