"""`kvserve gateway --backend URL [--backend URL ...] [--redis-url redis://...]` serves the gateway;
`kvserve gateway keys create|revoke|list` manages its API keys in the same store.

Start-up checks everything it can before listening, so a bad command line fails at once with one line: a
malformed or unreachable backend URL, a store that cannot be opened or a Redis that does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvserve.gateway.backend_auth import backend_credentials, uses_own_credentials
from kvserve.gateway.backends import BadBackendURL, normalize_backend_url
from kvserve.gateway.cache_scope import CACHE_SHARING
from kvserve.gateway.proxy import RetryPolicy
from kvserve.gateway.routing import POLICIES, RoutingConfig
from kvserve.gateway.settings import DEFAULT_STATE_PATH, GatewaySettings
from kvserve.gateway.redis_client import CLUSTER_MODES
from kvserve.gateway.store import StoreLimits, StoreUnavailable, connect_store, move_old_keys
from kvserve.gateway.urls import redacted_url
from kvserve.server.settings import DEFAULT_MAX_REQUEST_BYTES


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("KVSERVE_GATEWAY_REDIS_URL"),
                        help="keep sessions, prefixes, conversations, counters and keys in this Redis, shared by "
                             "every replica (default: $KVSERVE_GATEWAY_REDIS_URL, else the SQLite --state-path)")
    parser.add_argument("--state-path", default=DEFAULT_STATE_PATH,
                        help=f"the SQLite file used without --redis-url (default {DEFAULT_STATE_PATH})")
    parser.add_argument("--redis-cluster", choices=CLUSTER_MODES, default="auto",
                        help="whether --redis-url names a node of a Redis Cluster (then the gateway follows the "
                             "cluster's slot map); auto: ask the node at start (default)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # extend with nargs="+": `--backend A --backend B` and `--backend A B` alike, and a config file's list.
    parser.add_argument("--backend", action="extend", nargs="+", default=[], metavar="URL",
                        help="an OpenAI-compatible server (kvserve or vLLM) to route to; repeat for several")
    add_store_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--config", metavar="FILE.yaml", help="the same keys as the flags; the command line wins")
    parser.add_argument("--routing", choices=POLICIES, default="session",
                        help="session: sessions, prefixes, then load (default); round-robin: the baseline")
    parser.add_argument("--backend-api-key", default=os.environ.get("KVSERVE_BACKEND_API_KEY"),
                        help="sent as the bearer key to backends started with --api-key, except those whose URL "
                             "carries user:password@ (sent as basic auth instead; default: $KVSERVE_BACKEND_API_KEY)")
    parser.add_argument("--disable-auth", action="store_true",
                        help="serve without API keys (anyone who reaches the port can use the backends)")
    parser.add_argument("--load-factor", type=float, default=1.0,
                        help="the most live sessions a backend takes new ones at, as a multiple of the mean "
                             "(>= 1; default 1.0, see RoutingConfig)")
    parser.add_argument("--rebalance-ratio", type=float, default=2.0,
                        help="a held session moves to the shortest queue when its backend's queue (at least 4 "
                             "requests) is over this multiple of the mean and another backend is under it; one "
                             "cache miss per move (0: never for load; default 2.0)")
    parser.add_argument("--max-attempts", type=int, default=3, help="upstream attempts per request (default 3)")
    parser.add_argument("--health-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument("--breaker-failures", type=int, default=5,
                        help="consecutive failures that open a backend's circuit breaker (default 5)")
    parser.add_argument("--breaker-open-seconds", type=float, default=30.0)
    parser.add_argument("--conversation-ttl", type=int, default=86400, help="seconds a conversation is kept")
    parser.add_argument("--conversation-max-messages", type=int, default=256)
    parser.add_argument("--session-ttl", type=int, default=86400, help="seconds an idle session keeps its backend")
    parser.add_argument("--cache-sharing", choices=CACHE_SHARING, default="key",
                        help="key: each API key hits only its own prefix cache and prefix routes, so no tenant can "
                             "probe another's prompts (default); global: one cache for all, for trusted tenants")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest accepted request body, as the server's flag; bigger ones get 413 before "
                             f"they are read (default {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--log-level", default="info")
    keys = parser.add_subparsers(dest="gateway_command", metavar="{keys}")
    keys_parser = keys.add_parser("keys", help="create, revoke and list the gateway's API keys")
    actions = keys_parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a key and print it (the only time it is shown)")
    create.add_argument("--name", required=True)
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: unlimited)")
    create.add_argument("--tpm", type=int, default=0, help="prompt + completion tokens per minute (0: unlimited)")
    revoke = actions.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    actions.add_parser("list", help="list keys (ids and limits, never the keys)")
    for sub in (create, revoke, actions.choices["list"]):
        add_store_arguments(sub)
    from kvserve.server.config_file import track_explicit_options
    track_explicit_options(parser)  # so --config knows which options the command line gave


def run(args: argparse.Namespace) -> int:
    from kvserve.server.config_file import ConfigFileError

    try:
        if args.gateway_command == "keys":
            from kvserve.gateway.keys_cli import run_keys
            return run_keys(args)
        settings = settings_from_args(args)
        preflight(settings)
    except (ConfigFileError, BadBackendURL, StoreUnavailable, StartupError) as exc:
        print(f"kvserve gateway: {exc}", file=sys.stderr)
        return 2
    return serve(settings, args.host, args.port, args.log_level)


class StartupError(Exception):
    pass


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    if args.config:
        from kvserve.server.config_file import apply_config_file
        apply_config_file(_serve_parser(), args, args.config)  # a parser without the keys subcommand
    if not args.backend:
        raise StartupError("give at least one --backend URL")
    if args.load_factor < 1.0:
        raise StartupError("--load-factor must be at least 1")
    if args.rebalance_ratio < 0 or 0 < args.rebalance_ratio <= 1:
        raise StartupError("--rebalance-ratio must be 0 (off) or over 1")
    if args.max_request_bytes < 1:
        raise StartupError("--max-request-bytes must be at least 1")
    if args.max_attempts < 1:
        raise StartupError("--max-attempts must be at least 1")
    backends = list(dict.fromkeys(normalize_backend_url(url) for url in args.backend))
    return GatewaySettings(
        backends=backends, redis_url=args.redis_url, state_path=args.state_path,
        require_api_key=not args.disable_auth, backend_api_key=args.backend_api_key,
        routing=RoutingConfig(policy=args.routing, load_factor=args.load_factor,
                              rebalance_ratio=args.rebalance_ratio),
        retry=RetryPolicy(max_attempts=args.max_attempts),
        store_limits=StoreLimits(session_ttl_s=args.session_ttl, conversation_ttl_s=args.conversation_ttl,
                                 conversation_max_messages=args.conversation_max_messages),
        health_interval_s=args.health_interval, breaker_failures=args.breaker_failures,
        breaker_open_s=args.breaker_open_seconds, max_request_bytes=args.max_request_bytes,
        cache_sharing=args.cache_sharing, redis_cluster=args.redis_cluster,
    )


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve gateway")
    add_arguments(parser)
    return parser


def preflight(settings: GatewaySettings) -> None:
    """Every backend answers /health and the store answers, or a StartupError that says which does not."""
    import httpx

    for url in settings.backends:
        request_url, headers = backend_credentials(url, settings.backend_api_key)
        try:
            response = httpx.get(f"{request_url}/health", headers=headers, timeout=settings.health_timeout_s)
        except httpx.HTTPError as exc:
            raise StartupError(f"backend {redacted_url(url)} is unreachable ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise StartupError(f"backend {redacted_url(url)} answered /health with HTTP {response.status_code}")

    async def ping() -> None:
        store = await connect_store(settings.redis_url, settings.state_path, settings.store_limits,
                                    settings.redis_cluster)
        try:
            await store.ping()
            await move_old_keys(store)
        finally:
            await store.close()

    asyncio.run(ping())


def serve(settings: GatewaySettings, host: str, port: int, log_level: str) -> int:
    import logging

    import uvicorn

    from kvserve.gateway.app import build_app

    import importlib.util

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = f"Redis {redacted_url(settings.redis_url)}" if settings.redis_url else f"SQLite {settings.state_path}"
    # uvicorn's "auto" takes them when installed (pip install kvserve[gateway]): each saves Python work per request.
    fast = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is not None]
    backends = ", ".join(map(redacted_url, settings.backends))
    logging.getLogger("kvserve.gateway").info("gateway on %s:%d -> %s; state in %s; routing %s; %s%s", host, port,
                                               backends, store, settings.routing.policy,
                                               " and ".join(fast) if fast else "asyncio and h11 (no kvserve[gateway])",
                                               "" if settings.require_api_key else "; auth DISABLED")
    for url in settings.backends:
        if uses_own_credentials(url, settings.backend_api_key):
            logging.getLogger("kvserve.gateway").info("backend %s: basic auth from its URL; --backend-api-key is "
                                                       "not sent to it", redacted_url(url))
    uvicorn.run(build_app(settings), host=host, port=port, log_level=log_level.lower(), access_log=False)
    return 0
