"""Real parts for gateway tests: a redis-server process on a free port in a temp dir, and the gateway app served
by uvicorn in a thread (as server_harness serves kvserve backends)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from ports import free_port
import pytest
import uvicorn

from server_harness import MODEL_NAME, scrape_metrics, serve_in_thread, wait_until

from kvserve.gateway.app import build_app
from kvserve.gateway.settings import GatewaySettings

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                 reason="redis-server is not installed (apt-get install redis-server; .ci/run does)")



@dataclass
class RedisServer:
    port: int
    directory: Path
    process: subprocess.Popen
    bus_port: int | None = None  # a cluster node's: what CLUSTER MEET must name

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        result = subprocess.run([REDIS_CLI, "-p", str(self.port), "--raw", *args], capture_output=True, text=True,
                                timeout=10, check=True)
        return result.stdout

    def keys(self, pattern: str = "*") -> list[str]:
        return self.cli("KEYS", pattern).split()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def start_redis(directory: Path) -> RedisServer:
    """A single Redis (start_redis_cluster for a cluster)."""
    return _redis_process(directory, cluster=False)


def _redis_process(directory: Path, cluster: bool) -> RedisServer:
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # The cluster bus port named too: Redis's default, port + 10000, may be taken or past 65535.
    bus_port = free_port() if cluster else None
    cluster_args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-port", str(bus_port)] if cluster else []
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
         "--appendonly", "no", "--protected-mode", "no", *cluster_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    redis = RedisServer(port, directory, process, bus_port)

    def answers() -> bool:
        try:
            return redis.cli("PING").strip() == "PONG"
        except subprocess.CalledProcessError:
            return False

    if not wait_until(answers, timeout_s=10):
        redis.stop()
        raise AssertionError("redis-server did not start")
    return redis


SLOTS = 16384


def slot_range(index: int, masters: int) -> range:
    return range(index * SLOTS // masters, (index + 1) * SLOTS // masters)


@dataclass
class RedisClusterNodes:
    """A Redis Cluster of real redis-server processes, each a master of an equal share of the slots."""

    nodes: list[RedisServer]

    def owner_of(self, key: str) -> RedisServer:
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        return next(node for index, node in enumerate(self.nodes) if slot in slot_range(index, len(self.nodes)))

    def url_without(self, key: str) -> str:
        """The URL of a node that does not hold `key`'s slot: a plain client gets MOVED there."""
        return next(node.url for node in self.nodes if node is not self.owner_of(key))

    def cli(self, *args: str) -> str:
        """redis-cli in cluster mode (-c): it follows MOVED to the node holding the key."""
        result = subprocess.run([REDIS_CLI, "-c", "-p", str(self.nodes[0].port), "--raw", *args],
                                capture_output=True, text=True, timeout=10, check=True)
        return result.stdout

    @property
    def url(self) -> str:
        return self.url_without("{kvgw}")  # every gateway key's slot: the URL only a cluster client can use

    def keys(self, pattern: str = "*") -> list[str]:
        return [name for node in self.nodes for name in node.keys(pattern)]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(directory: Path, masters: int = 3) -> RedisClusterNodes:
    """`masters` redis-servers in cluster mode, joined with CLUSTER MEET, node i holding the i-th equal range of
    the slots (so owner_of can tell where a key lives), up when every node says cluster_state:ok."""
    cluster = RedisClusterNodes([])
    try:
        nodes = cluster.nodes
        for index in range(masters):
            nodes.append(_redis_process(directory / f"node{index}", cluster=True))
        for index, node in enumerate(nodes):
            slots = slot_range(index, masters)
            node.cli("CLUSTER", "ADDSLOTSRANGE", str(slots.start), str(slots.stop - 1))
        for node in nodes[1:]:
            node.cli("CLUSTER", "MEET", "127.0.0.1", str(nodes[0].port), str(nodes[0].bus_port))

        def ready() -> bool:
            return all("cluster_state:ok" in (info := node.cli("CLUSTER", "INFO"))
                       and f"cluster_known_nodes:{masters}" in info for node in nodes)

        assert wait_until(ready, timeout_s=30), "the cluster did not form"
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass
class RunningGateway:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    settings: GatewaySettings

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def openai(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def gateway_settings(backend_urls: list[str], redis_url: str | None = None, state_path: str | None = None,
                     **overrides) -> GatewaySettings:
    assert redis_url or state_path, "tests always say where the gateway's state goes"
    settings = GatewaySettings(backends=list(backend_urls), redis_url=redis_url, state_path=state_path or "",
                               require_api_key=False, health_interval_s=0.5)
    for name, value in overrides.items():
        setattr(settings, name, value)
    return settings


def start_gateway(settings: GatewaySettings) -> RunningGateway:
    url, server, thread = serve_in_thread(build_app(settings))
    return RunningGateway(url, server, thread, settings)


def kill_backend(backend) -> None:
    """The backend's port closes at once and its connections drop, in-flight or not (a crashed pod, not a
    graceful shutdown)."""
    backend.server.force_exit = True
    backend.server.should_exit = True
    backend.thread.join(timeout=30)
    assert not backend.thread.is_alive()


def chat(gateway: RunningGateway, content: str, api_key: str = "unused", max_tokens: int = 4, **extra):
    """A chat completion through the official client: (completion, the response headers)."""
    raw = gateway.openai(api_key).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        **extra)
    return raw.parse(), raw.headers


def conversation_turn(gateway: RunningGateway, conversation_id: str, messages: list[dict], max_tokens: int = 6,
                      **extra):
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"conversation": conversation_id}, **extra)
    return raw.parse(), raw.headers


def stored_messages(gateway: RunningGateway, conversation_id: str) -> list[dict]:
    response = httpx.get(f"{gateway.base_url}/conversations/{conversation_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    label_text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return samples.get(name + (f"{{{label_text}}}" if labels else ""), 0.0)


def start_of_a_window() -> int:
    """The current rate-limit window, waited for if this one is nearly over (every request of a test falls in one)."""
    from kvserve.gateway.limits import WINDOW_S

    if time.time() % WINDOW_S > WINDOW_S - 20:
        time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.1)
    return int(time.time() // WINDOW_S)


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    assert wait_until(predicate, timeout_s=timeout_s), "condition not reached"



def start_backends(tiny_model_dir, count: int, **server_args) -> list:
    """`count` real kvserve servers on the tiny llama."""
    from server_harness import start_server

    folder, _ = tiny_model_dir("llama")
    return [start_server(folder, **server_args) for _ in range(count)]


def stop_all(servers) -> None:
    for server in servers:
        if server.thread.is_alive():
            server.stop()


def backends_fixture(count: int, scope: str = "module", **server_args):
    """A fixture of `count` real backends (function scope for tests that kill them)."""

    @pytest.fixture(scope=scope)
    def backends(tiny_model_dir):
        running = start_backends(tiny_model_dir, count, **server_args)
        yield running
        stop_all(running)

    return backends


def redis_fixture(scope: str = "function"):
    """A fixture of a fresh redis-server (function scope: each test sees an empty store)."""

    @pytest.fixture(scope=scope)
    def redis(tmp_path_factory):
        server = start_redis(tmp_path_factory.mktemp("redis"))
        yield server
        server.stop()

    return redis
