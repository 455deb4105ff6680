"""`kvserve serve --log-requests-file PATH`: one JSON line per API request, the input of `kvserve advise`.

A line holds what a replay of the prefix cache needs to be exact: the prompt token ids the engine saw (after
the chat template and tokenization), the rendered prompt text, the request body as sent (messages or prompt),
the cache salt, the usage with cached tokens, the generated token ids (they fill blocks too), and the pool's
geometry (block size, number of blocks, hash algorithm).

PRIVACY: the file holds every prompt and completion in full. Treat it like the traffic itself: keep it off
shared disks, rotate and delete it, and turn the flag on for a diagnosis rather than permanently.

The request path pays only for queueing a reference: JSON encoding and file writes happen in a writer thread,
which flushes whenever it has drained its queue and once more at shutdown.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvserve.engine.outputs import RequestOutput
from kvserve.server.prompts import Prompt
from kvserve.server.stream_state import final_usage

LOG_FORMAT_VERSION = 1
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
    with open(Path(path).expanduser(), "a", encoding="utf-8"):
        pass


_STOP = object()


class RequestLog:
    """Appends LoggedRequest lines to a file from a writer thread."""

    def __init__(self, path: str, geometry: PoolGeometry) -> None:
        self.path = Path(path).expanduser()
        self.geometry = geometry
        self._file = open(self.path, "a", encoding="utf-8", buffering=1 << 20)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._write_forever, name="kvserve-request-log", daemon=True)
        self._thread.start()

    def record(self, entry: LoggedRequest) -> None:
        if self._closed:  # a stream that ended after shutdown began; the file is already closed
            logger.debug("request log closed; %s not logged", entry.request_id)
            return
        self._queue.put(entry)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    def _write_forever(self) -> None:
        try:
            while True:
                entry = self._queue.get()
                if entry is _STOP:
                    return
                self._write(entry)
                if self._queue.empty():
                    self._file.flush()
        finally:
            self._file.flush()
            self._file.close()

    def _write(self, entry: LoggedRequest) -> None:
        try:
            line = json.dumps(entry.as_json(self.geometry), ensure_ascii=False, separators=(",", ":"))
        except Exception:  # one odd request must not stop the log
            logger.exception("could not log request %s", entry.request_id)
            return
        self._file.write(line + "\n")


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
