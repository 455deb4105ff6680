"""Whose cached prompts a request may hit. A backend's prefix cache is shared by every request it serves and
reports `cached_tokens`, and the prefix index sends a prompt where a like one was served: together, anyone with
a key could test guesses at another key's prompts one block at a time. So by default (`--cache-sharing key`)
each key gets its own cache: the gateway sets each request's `cache_salt` (which kvserve and vLLM mix into every
block hash) to one derived from the key, combined with any salt the client sent (a client can split its own
cache further, never join another key's), and the prefix index is scoped the same way. `--cache-sharing global`
is for an operator who trusts every tenant: one cache for all, the client's salt passed on as it came."""

from __future__ import annotations

import hashlib

from kvserve.gateway.keys import KeyRecord

KEY, GLOBAL = "key", "global"
CACHE_SHARING = (KEY, GLOBAL)


def cache_salt_for(key: KeyRecord | None, client_salt: str | None, sharing: str) -> str | None:
    """The salt the backend gets: the key's own unless the cache is global or there are no keys."""
    assert sharing in CACHE_SHARING
    if sharing == GLOBAL or key is None:
        return client_salt
    # The record's random salt keeps it unguessable from a key id (which is not a secret).
    material = "\0".join((key.key_id, key.salt, client_salt or ""))
    return "kvgw-" + hashlib.sha256(material.encode()).hexdigest()


def session_scope(key: KeyRecord | None, sharing: str) -> str:
    """What a client's own session id (its x-session-id header or `user`) is prefixed with: the key's id when
    tenants are kept apart, so two keys' "alice" are two sessions and one key cannot steer, or learn from the
    backend header where another's session lives."""
    return f"{key.key_id}:" if sharing == KEY and key is not None else ""
