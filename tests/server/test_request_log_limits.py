"""`--log-requests-file` on bad days: the file is the owner's alone, a stalled writer drops (and counts) lines
instead of queueing them without bound, and a failing disk neither stops the writer nor the server."""

import logging
import os
import stat
import threading

from server_harness import MODEL_NAME, start_server, wait_until

from kvserve.server.prompts import Prompt
from kvserve.server.protocol import CompletionRequest
from kvserve.server.request_log import LoggedRequest, PoolGeometry, RequestLog
from kvserve.server.settings import ServerSettings

GEOMETRY = PoolGeometry(block_size=16, num_blocks=64, enable_prefix_caching=True, hash_algo="sha256")
PROMPT_CHARS = 200_000  # a line this long fills the writer's buffer and a pipe in a few lines


def logged_request(index: int, text: str) -> LoggedRequest:
    body = CompletionRequest(prompt=text)
    return LoggedRequest(0.0, f"cmpl-{index}", "/v1/completions", MODEL_NAME, body, [Prompt([5] * 100, text)], 1,
                         [None])


def serve_with_log(folder, log_path: str):
    return start_server(folder, ServerSettings(served_model_names=[MODEL_NAME], log_requests_file=log_path))


def send_completions(server, count: int) -> None:
    client = server.openai()
    for index in range(count):
        reply = client.completions.create(model=MODEL_NAME, prompt=f"request {index}", max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_log_file_is_created_owner_only(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    log_path = tmp_path / "requests.jsonl"
    server = serve_with_log(folder, str(log_path))
    try:
        send_completions(server, 2)
    finally:
        server.stop()
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert len(log_path.read_text().splitlines()) == 2


def test_the_folders_it_creates_are_owner_only(tmp_path):
    existing = tmp_path / "var"
    existing.mkdir(mode=0o755)
    log_path = existing / "logs" / "kvserve" / "requests.jsonl"
    old_umask = os.umask(0o022)  # the usual umask: a folder made without asking would be 0755
    try:
        request_log = RequestLog(str(log_path), GEOMETRY)
    finally:
        os.umask(old_umask)
    request_log.record(logged_request(0, "hello"))
    request_log.close()
    assert [stat.S_IMODE(folder.stat().st_mode) for folder in (existing, existing / "logs", log_path.parent)] == [
        0o755, 0o700, 0o700]  # a folder that was there is left as it was
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert len(log_path.read_text().splitlines()) == 1


def test_a_stalled_writer_drops_and_counts_lines_instead_of_queueing_them(tmp_path, caplog):
    fifo = tmp_path / "stalled.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # nobody reads it until the end: the writer blocks
    os.set_blocking(reader, True)
    max_queued = 4
    request_log = RequestLog(str(fifo), GEOMETRY, max_queued_entries=max_queued)
    num_recorded = 100
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        for index in range(num_recorded):
            request_log.record(logged_request(index, "x" * PROMPT_CHARS))
    num_accepted = num_recorded - request_log.num_dropped
    # The queue's bound plus the few lines the writer holds (its buffer, the pipe) before it blocks.
    assert max_queued <= num_accepted <= max_queued + 8, request_log.num_dropped
    assert any("dropped" in record.getMessage() for record in caplog.records)

    closer = threading.Thread(target=request_log.close)
    closer.start()
    written = read_until_closed(reader)
    closer.join(timeout=30)
    assert written.count(b"\n") == num_accepted


def read_until_closed(descriptor: int) -> bytes:
    chunks = []
    while chunk := os.read(descriptor, 1 << 20):
        chunks.append(chunk)
    os.close(descriptor)
    return b"".join(chunks)


def test_a_full_disk_neither_stops_the_writer_nor_the_server(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    server = serve_with_log(folder, "/dev/full")  # every write fails with ENOSPC
    try:
        send_completions(server, 3)
        assert wait_until(lambda: server.metrics().get("kvserve:request_log_write_errors_total", 0) >= 1)
        request_log = server.server.config.app.state.ctx.request_log
        assert request_log.writer_alive
        errors_before = request_log.num_write_errors
        send_completions(server, 3)  # still served, still attempted
        assert wait_until(lambda: request_log.num_write_errors > errors_before)
        assert request_log.writer_alive
    finally:
        server.stop()


def test_the_log_is_closed_whatever_stopping_the_engine_does(tiny_model_dir, tmp_path, monkeypatch):
    """Shutdown closes the request log before the engine saves its KV tiers, so a save that fails (here: the
    disk tier's volume gone) or a pod killed while it saves costs the log nothing."""
    folder, _ = tiny_model_dir("llama")
    log_path = tmp_path / "requests.jsonl"
    server = serve_with_log(folder, str(log_path))
    request_log = server.server.config.app.state.ctx.request_log

    def saving_fails():
        raise OSError("the KV disk tier's volume is gone")

    monkeypatch.setattr(server.engine.engine, "close", saving_fails)
    try:
        send_completions(server, 3)
    finally:
        server.stop()
    assert not request_log.writer_alive
    assert len(log_path.read_text().splitlines()) == 3
