"""API keys: `kvgw-<key id>-<secret>`. The store keeps the id (not secret: it names the key in `keys list` and in
rate-limit counters), a random salt and sha256(salt + key), never the key. A plain salted hash rather than a slow
KDF because the secret is 256 random bits, not a password: guessing it is hopeless however fast the hash, and a
slow hash would cost every request."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import asdict, dataclass

from kvserve.gateway.store import Store

KEY_PREFIX = "kvgw-"


@dataclass(slots=True)
class KeyRecord:
    key_id: str
    name: str
    salt: str
    key_hash: str
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0
    created_at: float = 0.0
    revoked: bool = False


def hash_key(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode()).hexdigest()


async def create_key(store: Store, name: str, requests_per_minute: int = 0,
                     tokens_per_minute: int = 0) -> tuple[str, KeyRecord]:
    """(the key, shown once; its record, as stored)."""
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
    salt = secrets.token_hex(16)
    record = KeyRecord(key_id, name, salt, hash_key(salt, key), requests_per_minute, tokens_per_minute, time.time())
    await store.key_put(key_id, asdict(record))
    return key, record


async def verify_key(store: Store, key: str) -> KeyRecord | None:
    key_id = key_id_of(key)
    if key_id is None:
        return None
    return check_key(await store.key_get(key_id), key)


def check_key(body: dict | None, key: str) -> KeyRecord | None:
    """The record stored for the key's id, if `key` is that record's key and it is not revoked."""
    if body is None:
        return None
    record = KeyRecord(**body)
    if record.revoked or not hmac.compare_digest(hash_key(record.salt, key), record.key_hash):
        return None
    return record


async def revoke_key(store: Store, key_id: str) -> bool:
    body = await store.key_get(key_id)
    if body is None:
        return False
    body["revoked"] = True
    await store.key_put(key_id, body)
    return True


async def list_keys(store: Store) -> list[KeyRecord]:
    return [KeyRecord(**body) for body in await store.key_list()]


def key_id_of(key: str) -> str | None:
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = key[len(KEY_PREFIX):].partition("-")
    return key_id if sep and key_id and secret else None
