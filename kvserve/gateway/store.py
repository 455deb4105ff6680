"""The gateway's shared state behind one interface: Redis when `--redis-url` is given (so replicas route alike),
an embedded SQLite file otherwise (so a restart keeps it). Nothing routing depends on lives only in memory.

What is stored:
- sessions: session id -> backend URL, with a last-seen time; a session unseen for `session_ttl_s` is forgotten
  and no longer counts toward its backend's share;
- the prefix index: prompt-block hash -> the backend that last served a prompt starting with that block chain,
  and when; plus each backend's cache horizon: entries recorded at or before it are gone from that backend's
  cache (it evicted them or restarted, see prefix_feedback) and no longer route;
- conversations: the messages of each conversation, in order, expiring after a TTL, bounded in length: past the
  bound the oldest messages go, except the leading system message(s); an append that names a request id is
  made once, a retry of the same request appends nothing;
- counters: rate-limit windows (they expire with their window);
- API keys: salted hashes and limits, never the key itself.

Every method is async: the Redis store never blocks the event loop, and the SQLite one (sqlite_store.py) runs
its statements on a thread of its own. Both expire what they keep by the same TTLs (StoreLimits). Failures of
the store raise `StoreUnavailable`, which the app answers with a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from kvserve.gateway.prefix import PrefixEntry, live_entries
from kvserve.gateway.recent import RecentWrites
from kvserve.gateway.redis_client import cluster_mode, failure_types, redis_client
from kvserve.gateway.request_state import RequestState, StateQuery
from kvserve.gateway.store_types import Store, StoreLimits, StoreUnavailable
from kvserve.gateway.urls import redacted_url

# Every Redis key carries the hash tag {kvgw}, so all of them map to one Redis Cluster slot: a request's one
# script call reads its key's record and counters, its session, its conversation and the prefix index with the
# horizons, shared by every key, so no per-tenant tag could hold one call's keys together (CROSSSLOT), nor those
# of set_session's MULTI. The gateway's load on Redis, a few commands per LLM request, fits one shard.
PREFIX = "{kvgw}:"
OLD_PREFIX = "kvgw:"  # before the tag; what a gateway stored under it is moved by move_old_keys

logger = logging.getLogger("kvserve.gateway")


def open_store(redis_url: str | None, state_path: str, limits: StoreLimits | None = None,
               cluster: bool = False) -> Store:
    """`cluster`: the Redis URL names a node of a Redis Cluster (see connect_store to find out)."""
    limits = limits or StoreLimits()
    if redis_url:
        return RedisStore(redis_url, limits, cluster)
    from kvserve.gateway.sqlite_store import SQLiteStore  # only when asked: most deployments use Redis

    return SQLiteStore(state_path, limits)


async def connect_store(redis_url: str | None, state_path: str, limits: StoreLimits | None = None,
                        redis_cluster: str = "auto") -> Store:
    """open_store with `--redis-cluster` (redis_client.CLUSTER_MODES) resolved: under auto the URL's node is
    asked whether it is a cluster node. StoreUnavailable when it does not answer."""
    cluster = False
    if redis_url:
        try:
            cluster = await cluster_mode(redis_url, redis_cluster)
        except failure_types() as exc:
            raise StoreUnavailable(f"Redis at {redacted_url(redis_url)} is unavailable ({type(exc).__name__})") from None
    return open_store(redis_url, state_path, limits, cluster)


# read_request_state's commands, those its query asks for, in this order. KEYS: the keys hash, the requests
# counter, the tokens counter, the session, the conversation, the prefix entries and the horizons hash, each
# only when asked. ARGV: the key id or '', the requests counter's TTL or '', the tokens limit or '', 1/0 for
# the session and the conversation, how many prefix entries, then the tokens wanted, 1/0 for taking the rest
# of the window and the tokens counter's TTL. A missing value comes back as nil. The tokens counter answers
# {used, reserved}: reserved 0 when the request's tokens would pass the limit (nothing is added then).
READ_STATE_SCRIPT = """
local out, next_key = {}, 1
local function key()
  next_key = next_key + 1
  return KEYS[next_key - 1]
end
if ARGV[1] ~= '' then out[#out + 1] = redis.call('HGET', key(), ARGV[1]) end
if ARGV[2] ~= '' then
  local counter = key()
  out[#out + 1] = redis.call('INCRBY', counter, 1)
  redis.call('EXPIRE', counter, ARGV[2])
end
if ARGV[3] ~= '' then
  local counter, limit, wanted = key(), tonumber(ARGV[3]), tonumber(ARGV[7])
  local used = tonumber(redis.call('GET', counter) or '0')
  if used + wanted > limit then
    out[#out + 1] = {used, 0}
  else
    local reserved = wanted
    if ARGV[8] == '1' then reserved = limit - used end
    out[#out + 1] = {redis.call('INCRBY', counter, reserved), reserved}
    redis.call('EXPIRE', counter, ARGV[9])
  end
end
if ARGV[4] == '1' then out[#out + 1] = redis.call('GET', key()) end
if ARGV[5] == '1' then out[#out + 1] = redis.call('LRANGE', key(), 0, -1) end
local num_prefixes = tonumber(ARGV[6])
if num_prefixes > 0 then
  out[#out + 1] = redis.call('MGET', unpack(KEYS, next_key, next_key + num_prefixes - 1))
  next_key = next_key + num_prefixes
  out[#out + 1] = redis.call('HGETALL', key())
end
return out
"""


# conversation_append's script. KEYS: the conversation, then the request's turn marker if it has an id. ARGV: the
# most messages kept, the TTL, then the messages. The marker (SET NX) makes a retried request's append a no-op.
# Past the bound the list keeps its leading system messages (read one by one: usually one) and the newest rest.
APPEND_SCRIPT = """
local conversation, bound, ttl = KEYS[1], tonumber(ARGV[1]), ARGV[2]
if KEYS[2] and not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ttl) then return 0 end
for first = 3, #ARGV, 1000 do
  redis.call('RPUSH', conversation, unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
redis.call('EXPIRE', conversation, ttl)
if redis.call('LLEN', conversation) <= bound then return 1 end
local head = {}
while #head < bound - 1 do
  local item = redis.call('LINDEX', conversation, #head)
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' or message.role ~= 'system' then break end
  head[#head + 1] = item
end
redis.call('LTRIM', conversation, #head - bound, -1)
for index = #head, 1, -1 do redis.call('LPUSH', conversation, head[index]) end
return 1
"""


class RedisStore:
    def __init__(self, url: str, limits: StoreLimits, cluster: bool = False) -> None:
        """`cluster`: a Redis Cluster node's URL, reached with redis-py's cluster client (redis_client)."""
        self.url = url
        self.limits = limits
        self.cluster = cluster
        self.recent = RecentWrites()
        self.redis = redis_client(url, cluster)
        self._errors = failure_types()
        self._read_state = self.redis.register_script(READ_STATE_SCRIPT)
        self._append = self.redis.register_script(APPEND_SCRIPT)

    async def _call(self, coroutine):
        try:
            return await coroutine
        except self._errors as exc:
            raise StoreUnavailable(f"Redis at {redacted_url(self.url)} is unavailable ({type(exc).__name__})") from None

    async def ping(self) -> None:
        await self._call(self.redis.ping())

    async def get_session(self, session_id: str) -> str | None:
        backend = await self._call(self.redis.get(f"{PREFIX}session:{session_id}"))
        if backend is not None and self.recent.due(session_id, backend):
            # Refreshing the TTL and last-seen time changes no routing decision: off the request's path, and
            # once a minute per session is plenty for a TTL of hours.
            spawn(self._refresh_session(session_id, backend))
        return backend

    async def _refresh_session(self, session_id: str, backend: str) -> None:
        # Never rewrites the mapping (a move may land first): EXPIRE, and XX updates only a member still there.
        pipe = self.redis.pipeline(transaction=True)
        pipe.expire(f"{PREFIX}session:{session_id}", self.limits.session_ttl_s)
        pipe.zadd(f"{PREFIX}backend_sessions:{backend}", {session_id: time.time()}, xx=True)
        await self._call(pipe.execute())

    async def set_session(self, session_id: str, backend: str, previous: str | None) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(f"{PREFIX}session:{session_id}", backend, ex=self.limits.session_ttl_s)
        pipe.zadd(f"{PREFIX}backend_sessions:{backend}", {session_id: time.time()})
        pipe.sadd(f"{PREFIX}backends", backend)
        if previous is not None and previous != backend:
            pipe.zrem(f"{PREFIX}backend_sessions:{previous}", session_id)
        await self._call(pipe.execute())

    async def session_counts(self) -> dict[str, int]:
        backends = await self._call(self.redis.smembers(f"{PREFIX}backends"))
        oldest = time.time() - self.limits.session_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for backend in sorted(backends):
            pipe.zremrangebyscore(f"{PREFIX}backend_sessions:{backend}", "-inf", oldest)
            pipe.zcard(f"{PREFIX}backend_sessions:{backend}")
        results = await self._call(pipe.execute())
        return {backend: int(count) for backend, count in zip(sorted(backends), results[1::2])}

    async def prefix_lookup(self, block_hashes: list[str]) -> list[PrefixEntry | None]:
        if not block_hashes:
            return []
        # The request-state script's prefix part: one call, where a cluster client refuses MGET in a pipeline.
        return (await self.read_request_state(StateQuery(prefix_hashes=block_hashes))).prefix_entries

    async def prefix_record(self, block_hashes: list[str], backend: str) -> None:
        if not block_hashes:
            return
        value = f"{backend} {time.time():.3f}"  # a URL holds no space
        pipe = self.redis.pipeline(transaction=False)
        for block_hash in block_hashes:
            pipe.set(f"{PREFIX}prefix:{block_hash}", value, ex=self.limits.prefix_ttl_s)
        await self._call(pipe.execute())

    async def prefix_expire(self, backend: str, horizon: float) -> None:
        # Only ever forward: a late report of an older eviction must not bring back what a newer one expired.
        script = ("local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') "
                  "if tonumber(ARGV[2]) > old then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end")
        await self._call(self.redis.eval(script, 1, f"{PREFIX}horizons", backend, f"{horizon:.3f}"))

    async def conversation_load(self, conversation_id: str) -> list[dict]:
        items = await self._call(self.redis.lrange(f"{PREFIX}conversation:{conversation_id}", 0, -1))
        return [json.loads(item) for item in items]

    async def conversation_append(self, conversation_id: str, messages: list[dict],
                                  request_id: str | None = None) -> None:
        keys = [f"{PREFIX}conversation:{conversation_id}"]
        if request_id is not None:
            keys.append(f"{PREFIX}turn:{conversation_id}:{request_id}")
        args = [self.limits.conversation_max_messages, self.limits.conversation_ttl_s,
                *(json.dumps(m, ensure_ascii=False) for m in messages)]
        await self._call(self._append(keys=keys, args=args))

    async def counter_add(self, name: str, amount: int, ttl_s: int) -> int:
        pipe = self.redis.pipeline(transaction=True)
        pipe.incrby(f"{PREFIX}counter:{name}", amount)
        pipe.expire(f"{PREFIX}counter:{name}", ttl_s)
        value, _ = await self._call(pipe.execute())
        return int(value)

    async def counter_get(self, name: str) -> int:
        value = await self._call(self.redis.get(f"{PREFIX}counter:{name}"))
        return int(value or 0)

    async def key_put(self, key_id: str, record: dict) -> None:
        await self._call(self.redis.hset(f"{PREFIX}keys", key_id, json.dumps(record)))

    async def key_get(self, key_id: str) -> dict | None:
        body = await self._call(self.redis.hget(f"{PREFIX}keys", key_id))
        return None if body is None else json.loads(body)

    async def key_list(self) -> list[dict]:
        bodies = await self._call(self.redis.hvals(f"{PREFIX}keys"))
        return sorted((json.loads(b) for b in bodies), key=lambda r: r["created_at"])

    async def read_request_state(self, query: StateQuery) -> RequestState:
        """One script call (EVALSHA): one round trip and one reply whatever the query holds, run atomically, the
        counter's INCRBY and EXPIRE together. (A MULTI/EXEC of the same commands is as atomic, but redis-py reads
        and checks a reply per command, QUEUED ones included: the better part of the gateway's Redis CPU.)"""
        keys = []
        if query.key_id is not None:
            keys.append(f"{PREFIX}keys")
        if query.requests_counter is not None:
            keys.append(f"{PREFIX}counter:{query.requests_counter}")
        if query.tokens_counter is not None:
            keys.append(f"{PREFIX}counter:{query.tokens_counter}")
        if query.session_id is not None:
            keys.append(f"{PREFIX}session:{query.session_id}")
        if query.conversation_id is not None:
            keys.append(f"{PREFIX}conversation:{query.conversation_id}")
        if query.prefix_hashes:
            keys += [f"{PREFIX}prefix:{h}" for h in query.prefix_hashes]
            keys.append(f"{PREFIX}horizons")
        cost = query.tokens_cost
        flags = [query.key_id or "", query.counter_ttl_s if query.requests_counter is not None else "",
                 query.tokens_limit if query.tokens_counter is not None else "", int(query.session_id is not None),
                 int(query.conversation_id is not None), len(query.prefix_hashes),
                 cost.wanted if cost else 0, int(cost is not None and cost.completion_tokens is None),
                 query.counter_ttl_s]
        results = iter(await self._call(self._read_state(keys=keys, args=flags)))
        state = RequestState()
        if query.key_id is not None:
            body = next(results)
            state.key_record = None if body is None else json.loads(body)
        if query.requests_counter is not None:
            state.requests_used = int(next(results))
        if query.tokens_counter is not None:
            state.tokens_used, state.tokens_reserved = (int(value) for value in next(results))
        if query.session_id is not None:
            state.session_backend = next(results)
            if state.session_backend is not None and self.recent.due(query.session_id, state.session_backend):
                spawn(self._refresh_session(query.session_id, state.session_backend))
        if query.conversation_id is not None:
            state.conversation = [json.loads(item) for item in next(results)]
        if query.prefix_hashes:
            values, horizons = next(results), next(results)
            state.prefix_entries = live_entries(values, dict(zip(horizons[::2], horizons[1::2])))
        return state

    async def move_old_keys(self) -> tuple[int, int]:
        """Moves what a gateway before the {kvgw} tag stored and still matters to the tagged names: the API keys
        (merged, a key stored under both names keeps the tagged record) and the conversations (renamed with
        their TTLs). Sessions, prefixes, horizons and counters are left to expire: traffic rebuilds them within
        minutes. Returns (keys moved, conversations moved); a second call finds nothing to move."""
        return await self._call(self._move_old_keys())

    async def _move_old_keys(self) -> tuple[int, int]:
        old_keys = await self.redis.hgetall(f"{OLD_PREFIX}keys")
        for key_id, body in old_keys.items():
            await self.redis.hsetnx(f"{PREFIX}keys", key_id, body)
        await self.redis.delete(f"{OLD_PREFIX}keys")
        conversations = 0
        async for name in self.redis.scan_iter(match=f"{OLD_PREFIX}conversation:*", count=1000):
            conversations += await self._rename_if_free(name, PREFIX + name[len(OLD_PREFIX):])
        return len(old_keys), conversations

    async def _rename_if_free(self, name: str, new_name: str) -> int:
        """RENAMENX; a cluster renames only within one slot, so there the value is copied (DUMP, RESTORE with its
        TTL) and the old name deleted. 0 when the new name is taken (the old one is left, as RENAMENX leaves it)."""
        if not self.cluster:
            return await self.redis.renamenx(name, new_name)
        from redis.exceptions import ResponseError

        payload, ttl_ms = await self.redis.dump(name), await self.redis.pttl(name)
        if payload is None or ttl_ms == -2:  # gone meanwhile (expired)
            return 0
        try:
            await self.redis.restore(new_name, max(ttl_ms, 0), payload)
        except ResponseError as exc:
            if "BUSYKEY" not in str(exc):
                raise
            return 0
        await self.redis.delete(name)
        return 1

    async def close(self) -> None:
        await self.redis.aclose()


_background: set[asyncio.Task] = set()


async def move_old_keys(store: Store) -> None:
    """At start: a Redis store moves what an older gateway stored to this layout (see RedisStore)."""
    if isinstance(store, RedisStore):
        moved_keys, moved_conversations = await store.move_old_keys()
        if moved_keys or moved_conversations:
            logger.info("moved %d API keys and %d conversations to the {kvgw} key layout", moved_keys,
                        moved_conversations)


def spawn(coroutine) -> None:
    """Runs a store write that no answer waits for; a failure is logged (the next request retries it)."""
    task = asyncio.get_running_loop().create_task(_logged(coroutine))
    _background.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_background.discard)


async def _logged(coroutine) -> None:
    try:
        await coroutine
    except Exception as exc:  # noqa: BLE001 - nobody awaits this task; say what failed and go on
        logger.warning("background store write failed: %s", exc)


async def drain_background() -> None:
    """Waits for the background writes (before the store closes)."""
    while _background:
        await asyncio.gather(*list(_background), return_exceptions=True)

