"""A real kvserve server on 127.0.0.1 (uvicorn in a thread, free port) over a tiny test model, for server tests."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings

MODEL_NAME = "tiny-llama"
ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256


@dataclass
class RunningServer:
    url: str
    engine: AsyncLLMEngine
    server: uvicorn.Server
    thread: threading.Thread
    settings: ServerSettings
    _clients: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def openai(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=60, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.base_url, max_retries=0, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label=value,...}' -> value (labels sorted, model_name/engine dropped)."""
        return scrape_metrics(self.url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_engine(model_dir: Path | None, max_waiting_requests: int | None = None, **engine_args) -> AsyncLLMEngine:
    """model_dir None: the demo model."""
    engine_args = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
                   "num_gpu_blocks_override": 256, **engine_args}
    model = None if model_dir is None else str(model_dir)
    engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
    return AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)


def start_server(model_dir: Path | None, settings: ServerSettings | None = None,
                 max_waiting_requests: int | None = None, shutdown_timeout_s: float = 5.0,
                 **engine_args) -> RunningServer:
    engine = make_engine(model_dir, max_waiting_requests, **engine_args)
    settings = settings or ServerSettings(served_model_names=[MODEL_NAME, ALIAS])
    settings.log_stats_interval_s = None
    app = build_app(engine, settings)
    url, server, thread = serve_in_thread(app, shutdown_timeout_s)
    return RunningServer(url, engine, server, thread, settings)


def serve_in_thread(app, shutdown_timeout_s: float = 5.0) -> tuple[str, uvicorn.Server, threading.Thread]:
    """An ASGI app served by uvicorn in a daemon thread on a free port of 127.0.0.1: (url, server, thread)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout_s,
                            access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, thread


def scrape_metrics(url: str, drop_labels: tuple[str, ...] = ("model_name", "engine")) -> dict[str, float]:
    """Every sample of url/metrics as 'name{label=value,...}' -> value (labels sorted, `drop_labels` dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in drop_labels}
            label_text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{label_text}}}" if labels else "")] = sample.value
    return samples


def slowed(step, seconds: float = 0.01):
    """An engine step that takes at least `seconds`: the tiny model is so fast (about 1 ms a token) that a
    "long" request would otherwise finish before a test can disconnect from it or signal the server."""

    def slow_step():
        time.sleep(seconds)
        return step()

    return slow_step


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def assert_envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error
