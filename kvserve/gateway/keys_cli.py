"""`kvserve gateway keys create|revoke|list`: the key is printed once, at creation; the store never holds it."""

from __future__ import annotations

import argparse
import asyncio
import time

from kvserve.gateway.keys import create_key, list_keys, revoke_key
from kvserve.gateway.store import connect_store, move_old_keys


def run_keys(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    store = await connect_store(args.redis_url, args.state_path, redis_cluster=args.redis_cluster)
    try:
        await store.ping()
        await move_old_keys(store)
        if args.keys_action == "create":
            key, record = await create_key(store, args.name, args.rpm, args.tpm)
            print(key)
            print(f"id {record.key_id}, name {record.name!r}, {_limits(record.requests_per_minute, record.tokens_per_minute)}"
                  " (the key is shown only now; the gateway keeps a salted hash of it)")
            return 0
        if args.keys_action == "revoke":
            if not await revoke_key(store, args.key_id):
                print(f"kvserve gateway keys: no key with id {args.key_id!r}")
                return 1
            print(f"revoked {args.key_id}")
            return 0
        for record in await list_keys(store):
            created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(record.created_at))
            state = "revoked" if record.revoked else "active"
            print(f"{record.key_id}  {state:7}  {created} UTC  "
                  f"{_limits(record.requests_per_minute, record.tokens_per_minute)}  {record.name}")
        return 0
    finally:
        await store.close()


def _limits(rpm: int, tpm: int) -> str:
    return f"rpm {rpm or 'unlimited'}, tpm {tpm or 'unlimited'}"
