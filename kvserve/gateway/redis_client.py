"""The gateway's Redis client: redis-py's plain client for one Redis (or a proxy that hides a cluster), its
RedisCluster for a Redis Cluster. A cluster node answers a key whose slot another node holds with MOVED, which
only the cluster client follows: it reads the slot map (CLUSTER SLOTS) from the node in the URL and sends each
command, script and transaction to the node that holds the `{kvgw}` slot, following the map when slots move.

`--redis-cluster auto` (the default) asks the URL's node `INFO cluster` once at start, so a cluster is used as
one without a flag; `yes` or `no` decide without asking (a server whose INFO is renamed or refused is taken
for a single Redis under auto)."""

from __future__ import annotations

CLUSTER_MODES = ("auto", "yes", "no")


def redis_client(url: str, cluster: bool):
    """A client with the gateway's short timeouts and one retry: a dead Redis must become a prompt 503, never a
    hung request."""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options = dict(decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0,
                   retry=Retry(NoBackoff(), 1), health_check_interval=0)
    if cluster:
        return redis.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def failure_types() -> tuple[type[BaseException], ...]:
    """What either client raises when Redis (or a cluster's slot owner) cannot answer."""
    from redis.exceptions import ClusterError, ConnectionError, RedisClusterException, TimeoutError

    return ConnectionError, TimeoutError, OSError, ClusterError, RedisClusterException


async def is_cluster(url: str) -> bool:
    """Whether the URL's node is a Redis Cluster node (`cluster_enabled:1`)."""
    from redis.exceptions import ResponseError

    client = redis_client(url, cluster=False)
    try:
        info = await client.info("cluster")
    except ResponseError:  # INFO renamed or refused (a proxy, a managed service): a single Redis as far as we know
        return False
    finally:
        await client.aclose()
    return str(info.get("cluster_enabled", 0)) == "1"


async def cluster_mode(url: str, mode: str) -> bool:
    """`mode` (CLUSTER_MODES) resolved for this URL."""
    if mode == "auto":
        return await is_cluster(url)
    return mode == "yes"
