"""The gateway on a real Redis Cluster: three redis-server masters, the gateway and `kvserve gateway keys` given the
URL of a node that does not hold the `{kvgw}` slot (a single-node client gets MOVED there). Both find the node to
be a cluster node and follow the slot map: keys, rate limits, sessions and conversations work, and everything the
gateway stores is on the node holding the slot."""

from __future__ import annotations

import httpx
import pytest

from gateway_harness import (
    MODEL_NAME, backends_fixture, chat, gateway_settings, needs_redis, start_gateway, start_of_a_window,
    start_redis_cluster,
)
from server_harness import assert_envelope

pytestmark = needs_redis

backends = backends_fixture(2)


@pytest.fixture()
def cluster(tmp_path):
    nodes = start_redis_cluster(tmp_path / "cluster")
    yield nodes
    nodes.stop()


def create_key(redis_url: str, capsys, requests_per_minute: int) -> str:
    """A key made by `kvserve gateway keys create`, as an operator would."""
    from kvserve.cli import main

    assert main(["gateway", "keys", "create", "--name", "tenant", "--rpm", str(requests_per_minute),
                 "--redis-url", redis_url]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_keys_limits_sessions_and_conversations_work_through_a_node_without_the_slot(backends, cluster, capsys):
    key = create_key(cluster.url, capsys, requests_per_minute=6)
    gateway = start_gateway(gateway_settings([b.url for b in backends], redis_url=cluster.url,
                                             require_api_key=True))
    client = gateway.openai(key)
    try:
        start_of_a_window()
        answers = [chat(gateway, f"hello {index}", api_key=key, user="alice")[1] for index in range(3)]
        for content in ("Name a colour.", "And another?"):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=3, temperature=0, extra_body={"conversation": "c1"})
        stored = httpx.get(f"{gateway.base_url}/conversations/c1", headers={"Authorization": f"Bearer {key}"},
                           timeout=10).json()["messages"]
        sixth = chat(gateway, "one more", api_key=key)[1]
        seventh = httpx.post(f"{gateway.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             timeout=30, json={"model": MODEL_NAME, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "past the limit"}]})
    finally:
        gateway.stop()
    routes = [headers["x-kvserve-route"] for headers in answers]
    assert routes[0] in ("session_new", "bounded") and routes[1:] == ["session", "session"]  # placed, then held
    assert len({headers["x-kvserve-backend"] for headers in answers}) == 1  # the session stuck to its backend
    assert [m["content"] for m in stored if m["role"] == "user"] == ["Name a colour.", "And another?"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert sixth["x-ratelimit-remaining-requests"] == "0"
    assert assert_envelope(seventh, 429)["type"] == "requests"
    owner = cluster.owner_of("{kvgw}")
    stored_names = owner.keys()
    assert any(name.startswith("{kvgw}:session:") for name in stored_names)
    assert any(name.startswith("{kvgw}:conversation:") for name in stored_names)
    assert [name for node in cluster.nodes if node is not owner for name in node.keys()] == []
