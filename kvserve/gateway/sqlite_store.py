"""The gateway's embedded store: one SQLite file, for a gateway without Redis (see store.py for what is kept).

SQLite's calls block, so they run on the store's own thread, never on the event loop; one thread also
serializes them, which a single connection needs. Several gateway processes may share the file: WAL lets them
read while one writes, and a write that finds the file locked waits at most BUSY_TIMEOUT_S, then is a
StoreUnavailable (a 503 the client may retry) rather than every request queueing behind it for seconds.
What Redis expires by TTL is deleted here by a sweep, at most once a SWEEP_INTERVAL_S, run by the first call
after it is due, so the file holds what the same TTLs keep and no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvserve.gateway.prefix import PrefixEntry
from kvserve.gateway.request_state import RequestState, StateQuery
from kvserve.gateway.store_types import StoreLimits, StoreUnavailable

BUSY_TIMEOUT_S = 0.25  # another process's write takes microseconds; a lock held longer is a fault to report
SWEEP_INTERVAL_S = 60.0

logger = logging.getLogger("kvserve.gateway")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, backend TEXT NOT NULL, seen REAL NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_backend ON sessions (backend, seen);
CREATE INDEX IF NOT EXISTS sessions_by_seen ON sessions (seen);
CREATE TABLE IF NOT EXISTS prefixes (block_hash TEXT PRIMARY KEY, backend TEXT NOT NULL, seen REAL NOT NULL);
CREATE INDEX IF NOT EXISTS prefixes_by_seen ON prefixes (seen);
CREATE TABLE IF NOT EXISTS horizons (backend TEXT PRIMARY KEY, horizon REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (conversation_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
                                     seen REAL NOT NULL, PRIMARY KEY (conversation_id, seq));
CREATE INDEX IF NOT EXISTS messages_by_seen ON messages (seen);
CREATE TABLE IF NOT EXISTS turns (conversation_id TEXT NOT NULL, request_id TEXT NOT NULL, seen REAL NOT NULL,
                                  PRIMARY KEY (conversation_id, request_id));
CREATE INDEX IF NOT EXISTS turns_by_seen ON turns (seen);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS counters_by_expiry ON counters (expires);
CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, body TEXT NOT NULL);
"""


def _is_system(body: str) -> bool:
    message = json.loads(body)
    return isinstance(message, dict) and message.get("role") == "system"


class SQLiteStore:
    def __init__(self, path: str, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.limits = limits
        self.clock = clock
        self._next_sweep = 0.0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-gateway-sqlite")
        try:
            self.db = self._connect(Path(path).expanduser())
        except sqlite3.Error as exc:
            self._thread.shutdown()
            raise self._unavailable(exc) from None

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit (isolation_level None); used from the store's thread only, opened here so a bad path fails
        # at start.
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        db.execute("PRAGMA journal_mode=WAL")
        # No fsync per commit (WAL makes that safe against corruption): a commit costs microseconds, not a
        # millisecond, on every request; a power cut may lose the last moments of routing state, never the file.
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    async def _call(self, function: Callable, *args):
        """function(*args) on the store's thread; any SQLite error is a StoreUnavailable."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._guarded, function, args)

    def _guarded(self, function: Callable, args: tuple):
        self._sweep_if_due()
        try:
            return function(*args)
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from None

    def _unavailable(self, exc: sqlite3.Error) -> StoreUnavailable:
        if str(exc) == "database is locked":  # SQLITE_BUSY past the busy timeout
            return StoreUnavailable(f"state file {self.path} is busy: another process held its write lock for "
                                    f"over {BUSY_TIMEOUT_S} s")
        return StoreUnavailable(f"state file {self.path}: {exc}")

    def _rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        return self.db.execute(sql, params).fetchall()

    # The sweep: what Redis would have expired by now.

    def _sweep_if_due(self) -> None:
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        try:
            self._sweep(now)
        except sqlite3.Error as exc:  # the next sweep tries again; the request need not fail for it
            logger.warning("could not delete expired rows from %s: %s", self.path, exc)

    def _sweep(self, now: float) -> None:
        limits = self.limits
        self.db.execute("DELETE FROM sessions WHERE seen <= ?", (now - limits.session_ttl_s,))
        self.db.execute("DELETE FROM prefixes WHERE seen <= ?", (now - limits.prefix_ttl_s,))
        self.db.execute("DELETE FROM messages WHERE seen <= ?", (now - limits.conversation_ttl_s,))
        self.db.execute("DELETE FROM turns WHERE seen <= ?", (now - limits.conversation_ttl_s,))
        self.db.execute("DELETE FROM counters WHERE expires <= ?", (now,))

    # The Store interface: each call one trip to the store's thread.

    async def ping(self) -> None:
        await self._call(self._rows, "SELECT 1")

    async def get_session(self, session_id: str) -> str | None:
        return await self._call(self._get_session, session_id)

    async def set_session(self, session_id: str, backend: str, previous: str | None) -> None:
        await self._call(self._rows, "INSERT INTO sessions VALUES (?, ?, ?) ON CONFLICT (session_id) DO UPDATE "
                         "SET backend = excluded.backend, seen = excluded.seen", (session_id, backend, self.clock()))

    async def session_counts(self) -> dict[str, int]:
        rows = await self._call(self._rows, "SELECT backend, count(*) FROM sessions WHERE seen > ? GROUP BY backend",
                                (self.clock() - self.limits.session_ttl_s,))
        return {backend: count for backend, count in rows}

    async def prefix_lookup(self, block_hashes: list[str]) -> list[PrefixEntry | None]:
        return await self._call(self._prefix_lookup, block_hashes)

    async def prefix_record(self, block_hashes: list[str], backend: str) -> None:
        await self._call(self._prefix_record, block_hashes, backend)

    async def prefix_expire(self, backend: str, horizon: float) -> None:
        await self._call(self._rows, "INSERT INTO horizons VALUES (?, ?) ON CONFLICT (backend) DO UPDATE "
                         "SET horizon = max(horizon, excluded.horizon)", (backend, horizon))

    async def conversation_load(self, conversation_id: str) -> list[dict]:
        return await self._call(self._conversation_load, conversation_id)

    async def conversation_append(self, conversation_id: str, messages: list[dict],
                                  request_id: str | None = None) -> None:
        await self._call(self._conversation_append, conversation_id, messages, request_id)

    async def counter_add(self, name: str, amount: int, ttl_s: int) -> int:
        return await self._call(self._counter_add, name, amount, ttl_s)

    async def counter_get(self, name: str) -> int:
        rows = await self._call(self._rows, "SELECT value FROM counters WHERE name = ? AND expires > ?",
                                (name, self.clock()))
        return int(rows[0][0]) if rows else 0

    async def key_put(self, key_id: str, record: dict) -> None:
        await self._call(self._rows, "INSERT OR REPLACE INTO api_keys VALUES (?, ?)", (key_id, json.dumps(record)))

    async def key_get(self, key_id: str) -> dict | None:
        return await self._call(self._key_get, key_id)

    async def key_list(self) -> list[dict]:
        rows = await self._call(self._rows, "SELECT body FROM api_keys")
        return sorted((json.loads(body) for (body,) in rows), key=lambda r: r["created_at"])

    async def read_request_state(self, query: StateQuery) -> RequestState:
        return await self._call(self._read_request_state, query)

    async def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed before
            await self._call(self.db.close)
        self._thread.shutdown()

    # What runs on the store's thread.

    def _get_session(self, session_id: str) -> str | None:
        now = self.clock()
        rows = self._rows("SELECT backend FROM sessions WHERE session_id = ? AND seen > ?",
                          (session_id, now - self.limits.session_ttl_s))
        if not rows:
            return None
        self.db.execute("UPDATE sessions SET seen = ? WHERE session_id = ?", (now, session_id))
        return rows[0][0]

    def _prefix_lookup(self, block_hashes: list[str]) -> list[PrefixEntry | None]:
        if not block_hashes:
            return []
        marks = ",".join("?" * len(block_hashes))
        rows = self._rows(f"SELECT block_hash, prefixes.backend, seen FROM prefixes LEFT JOIN horizons "
                          f"ON horizons.backend = prefixes.backend WHERE block_hash IN ({marks}) AND seen > ? "
                          f"AND seen > coalesce(horizon, 0)",
                          (*block_hashes, self.clock() - self.limits.prefix_ttl_s))
        found = {block_hash: (backend, seen) for block_hash, backend, seen in rows}
        return [found.get(h) for h in block_hashes]

    def _prefix_record(self, block_hashes: list[str], backend: str) -> None:
        now = self.clock()
        self.db.executemany("INSERT OR REPLACE INTO prefixes VALUES (?, ?, ?)",
                            [(h, backend, now) for h in block_hashes])

    def _conversation_load(self, conversation_id: str) -> list[dict]:
        rows = self._rows("SELECT body FROM messages WHERE conversation_id = ? AND seen > ? ORDER BY seq",
                          (conversation_id, self.clock() - self.limits.conversation_ttl_s))
        return [json.loads(body) for (body,) in rows]

    def _conversation_append(self, conversation_id: str, messages: list[dict], request_id: str | None) -> None:
        """As the Redis script: once per request id, then trimmed past the bound keeping the leading system
        messages."""
        now = self.clock()
        with self._transaction():
            if request_id is not None and not self.db.execute(
                    "INSERT OR IGNORE INTO turns VALUES (?, ?, ?)", (conversation_id, request_id, now)).rowcount:
                return  # this request's turn is stored already
            (last,) = self.db.execute("SELECT coalesce(max(seq), -1) FROM messages WHERE conversation_id = ?",
                                      (conversation_id,)).fetchone()
            rows = [(conversation_id, last + 1 + i, json.dumps(m, ensure_ascii=False), now)
                    for i, m in enumerate(messages)]
            self.db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?)", rows)
            self._trim_conversation(conversation_id)
            # The TTL runs from the last turn, as Redis's EXPIRE on every append does.
            self.db.execute("UPDATE messages SET seen = ? WHERE conversation_id = ?", (now, conversation_id))

    def _trim_conversation(self, conversation_id: str) -> None:
        bound = self.limits.conversation_max_messages
        (count,) = self.db.execute("SELECT count(*) FROM messages WHERE conversation_id = ?",
                                   (conversation_id,)).fetchone()
        if count <= bound:
            return
        head = self._leading_system_seqs(conversation_id, bound - 1)
        # Seqs have gaps once a trim kept a head: the newest rows are counted, not computed from seq.
        self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND seq > ? AND seq NOT IN (SELECT seq FROM "
                        "messages WHERE conversation_id = ? ORDER BY seq DESC LIMIT ?)",
                        (conversation_id, head[-1] if head else -1, conversation_id, bound - len(head)))

    def _leading_system_seqs(self, conversation_id: str, most: int) -> list[int]:
        seqs = []
        with contextlib.closing(self.db.execute("SELECT seq, body FROM messages WHERE conversation_id = ? "
                                                "ORDER BY seq LIMIT ?", (conversation_id, most))) as rows:
            for seq, body in rows:  # read lazily: the first that is not a system message ends it
                if not _is_system(body):
                    break
                seqs.append(seq)
        return seqs

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT; any SQLite error, a failed ROLLBACK included (a BEGIN that never began has
        nothing to roll back), is raised for _guarded to make a StoreUnavailable, never a 500."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            yield
            self.db.execute("COMMIT")
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise

    def _counter_add(self, name: str, amount: int, ttl_s: int) -> int:
        now = self.clock()
        self.db.execute("DELETE FROM counters WHERE name = ? AND expires <= ?", (name, now))
        rows = self._rows("INSERT INTO counters VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE "
                          "SET value = value + excluded.value RETURNING value", (name, amount, now + ttl_s))
        return int(rows[0][0])

    def _reserve_tokens(self, query: StateQuery) -> tuple[int, int]:
        """(the window's tokens, what this request reserved: 0 if refused), as the Redis script decides."""
        cost, limit, name = query.tokens_cost, query.tokens_limit, query.tokens_counter
        with self._transaction():
            now = self.clock()
            rows = self._rows("SELECT value FROM counters WHERE name = ? AND expires > ?", (name, now))
            used = int(rows[0][0]) if rows else 0
            if used + cost.wanted > limit:
                return used, 0
            reserved = limit - used if cost.completion_tokens is None else cost.wanted
            self.db.execute("INSERT OR REPLACE INTO counters VALUES (?, ?, ?)",
                            (name, used + reserved, now + query.counter_ttl_s))
            return used + reserved, reserved

    def _key_get(self, key_id: str) -> dict | None:
        rows = self._rows("SELECT body FROM api_keys WHERE key_id = ?", (key_id,))
        return json.loads(rows[0][0]) if rows else None

    def _read_request_state(self, query: StateQuery) -> RequestState:
        # One trip to the store's thread; the statements one after another cost microseconds there.
        state = RequestState()
        if query.key_id is not None:
            state.key_record = self._key_get(query.key_id)
        if query.requests_counter is not None:
            state.requests_used = self._counter_add(query.requests_counter, 1, query.counter_ttl_s)
        if query.tokens_counter is not None:
            state.tokens_used, state.tokens_reserved = self._reserve_tokens(query)
        if query.session_id is not None:
            state.session_backend = self._get_session(query.session_id)
        if query.conversation_id is not None:
            state.conversation = self._conversation_load(query.conversation_id)
        state.prefix_entries = self._prefix_lookup(query.prefix_hashes)
        return state
