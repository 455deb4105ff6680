"""One completion request through the gateway: authenticate, count against the key's limits, expand a
conversation, route, open upstream (with retries), then answer with the backend's response, whole or streamed,
and store the conversation turn and the tokens once the answer is complete."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from kvserve.gateway import limits
from kvserve.gateway.backends import Backend
from kvserve.gateway.cache_scope import cache_salt_for, session_scope
from kvserve.gateway.conversation import (
    IDEMPOTENCY_HEADER, ConversationTurn, answer_of, put_history_first, record_turn, take_conversation,
)
from kvserve.gateway.disconnect import ClientLeft, unless_client_leaves
from kvserve.gateway.key_cache import VerifiedKeys
from kvserve.gateway.keys import KeyRecord, check_key, verify_key
from kvserve.gateway.limits import LimitState
from kvserve.gateway.metrics import BACKEND_ERROR, CLIENT_ERROR, CLIENT_GONE, SUCCESS, UNAVAILABLE, GatewayMetrics
from kvserve.gateway.prefix import cache_counts, prefix_block_hashes
from kvserve.gateway.proxy import Upstream, UpstreamFailed, open_upstream
from kvserve.gateway.request_body import read_completion_body, upstream_content
from kvserve.gateway.request_state import RequestState, StateQuery
from kvserve.gateway.routing import Router
from kvserve.gateway.settings import GatewaySettings
from kvserve.gateway.store import Store, StoreUnavailable, spawn
from kvserve.gateway.stream import StreamTap, UpstreamStreamResponse, sse_events
from kvserve.gateway.token_budget import TokenCost, TokenReservation, estimated_chat_tokens, request_cost
from kvserve.server.auth import bearer_token
from kvserve.server.errors import SERVER_ERROR, APIError, bad_request
from kvserve.server.sse import SSE_HEADERS

SESSION_HEADER = "x-session-id"
BACKEND_HEADER = "x-kvserve-backend"  # which backend answered, and why: for operators and tests
ROUTE_HEADER = "x-kvserve-route"
CLIENT_CLOSED_REQUEST = 499

logger = logging.getLogger("kvserve.gateway")


@dataclass(slots=True)
class Gateway:
    settings: GatewaySettings
    store: Store
    backends: list[Backend]
    router: Router
    metrics: GatewayMetrics
    http: aiohttp.ClientSession  # every request to a backend: completions, the models list, health checks
    verified_keys: VerifiedKeys = field(default_factory=VerifiedKeys)


@dataclass(slots=True)
class Exchange:
    """One client request on its way through."""

    path: str
    body: dict
    key: KeyRecord | None
    limit: LimitState | None
    turn: ConversationTurn | None
    session_id: str | None
    block_hashes: list[str]  # the prompt's blocks as sent (history included), for the prefix index
    reservation: TokenReservation | None = None  # the key's tokens/min taken at admission, settled at the end
    upstream: Upstream | None = None  # once a backend took the request

    def response_headers(self, upstream: Upstream) -> dict[str, str]:
        headers = {BACKEND_HEADER: upstream.backend.shown_url, ROUTE_HEADER: upstream.decision.reason}
        if self.limit is not None:
            headers.update(self.limit.headers())
        return headers


async def authenticate(gateway: Gateway, request: Request) -> KeyRecord | None:
    """The request's key checked against its stored record (one store read), None when auth is disabled."""
    if not gateway.settings.require_api_key:
        return None
    key = _presented_key(request)
    record = await verify_key(gateway.store, key) if key else None
    if record is None:
        raise _unauthorized(gateway)
    return record


async def key_verified_before(gateway: Gateway, request: Request) -> tuple[str, KeyRecord] | None:
    """(key, record) for a completion: a key this process verified before is taken as it was until the request's
    state read checks it again (recheck_key); a new one is verified now. None when auth is disabled."""
    if not gateway.settings.require_api_key:
        return None
    key = _presented_key(request)
    if not key:
        raise _unauthorized(gateway)
    record = gateway.verified_keys.get(key)
    if record is None:
        record = await verify_key(gateway.store, key)
        if record is None:
            raise _unauthorized(gateway)
        gateway.verified_keys.put(key, record)
    return key, record


def recheck_key(gateway: Gateway, key: str, state: RequestState) -> KeyRecord:
    """The key against its record as the request's state read found it: revoked since is a 401 now."""
    record = check_key(state.key_record, key)
    if record is None:
        gateway.verified_keys.forget(key)
        raise _unauthorized(gateway)
    gateway.verified_keys.put(key, record)
    return record


def _presented_key(request: Request) -> str | None:
    token = bearer_token(request.headers.get("authorization", "").encode())
    return token.decode(errors="replace") if token else None


def _unauthorized(gateway: Gateway) -> APIError:
    gateway.metrics.rejected.labels("unauthorized").inc()
    return APIError(401, "Incorrect API key provided. Send a key from `kvserve gateway keys create` as "
                    "'Authorization: Bearer <key>'.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def check_limits(gateway: Gateway, key: KeyRecord, state: RequestState, reset_s: float,
                 cost: TokenCost) -> LimitState:
    limit = limits.limit_state(key, state, reset_s)
    if limit.exceeded is not None:
        raise _rate_limited(gateway, key, limit, limit.exceeded, cost.wanted)
    return limit


async def _reserve_history(gateway: Gateway, key: KeyRecord, limit: LimitState, reservation: TokenReservation,
                           history_tokens: int) -> None:
    """A conversation's stored history is prompt too: reserved before the turn is sent, or a 429."""
    if not await limits.reserve_more(gateway.store, reservation, history_tokens, key.tokens_per_minute):
        _refund(gateway, reservation)
        raise _rate_limited(gateway, key, limit, "tokens", reservation.prompt_tokens + 1)


def _rate_limited(gateway: Gateway, key: KeyRecord, limit: LimitState, exceeded: str, wanted: int) -> APIError:
    gateway.metrics.rejected.labels(f"rate_limit_{exceeded}").inc()
    allowed = limit.requests_limit if exceeded == "requests" else limit.tokens_limit
    # OpenAI's wording for a request no window could take, so a client does not retry it for ever.
    too_large = exceeded == "tokens" and wanted > allowed
    message = (f"Request too large for key {key.key_id} on tokens per minute: limit {allowed}, requested at "
               f"least {wanted} (prompt estimated from its bytes, plus max_tokens)." if too_large else
               f"Rate limit reached for key {key.key_id} on {exceeded} per minute: limit {allowed}. "
               f"Try again in {math.ceil(limit.reset_s)}s.")
    return APIError(429, message, type=exceeded, code="rate_limit_exceeded",
                    headers={**limit.headers(), "Retry-After": str(math.ceil(limit.reset_s))})


async def forward_completion(gateway: Gateway, request: Request, path: str, chat: bool) -> Response:
    presented = await key_verified_before(gateway, request)
    key = presented[1] if presented else None
    raw, body, fields = await read_completion_body(request, gateway.settings.max_request_bytes, chat)
    if "conversation" in body and not chat:
        raise bad_request("conversation is only for /v1/chat/completions", param="conversation")
    request_id = request.headers.get(IDEMPOTENCY_HEADER)
    turn = take_conversation(body, key.key_id if key else None, request_id) if chat else None
    scope = session_scope(key, gateway.settings.cache_sharing)
    session_id = turn.session_id if turn else _header_session(request, scope) or _user_of(body, scope)
    salt = cache_salt_for(key, fields.cache_salt, gateway.settings.cache_sharing)
    block_hashes = [] if turn else prefix_block_hashes(body, gateway.settings.prefix_block_chars, salt)
    state, key, limit, reservation = await _read_state(gateway, presented, turn, session_id, block_hashes,
                                                       request_cost(body, chat))
    if turn:
        put_history_first(body, turn, state.conversation)
        block_hashes = prefix_block_hashes(body, gateway.settings.prefix_block_chars, salt)
        if reservation is not None:  # admission counted the new messages; the history is known only now
            await _reserve_history(gateway, key, limit, reservation, estimated_chat_tokens(state.conversation))
    stream = bool(fields.stream)
    drop_usage = stream and key is not None and key.tokens_per_minute > 0 and not _asked_usage(body)
    if drop_usage:  # the gateway must count this stream's tokens; the client did not ask to see them
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    content = upstream_content(raw, body, turn is not None or drop_usage,
                               salt if salt != fields.cache_salt else None)
    exchange = Exchange(path, body, key, limit, turn, session_id, block_hashes, reservation)
    try:
        return await unless_client_leaves(request, _answer(gateway, exchange, content, state, stream, drop_usage))
    except ClientLeft:
        return _client_left(gateway, exchange)


async def _answer(gateway: Gateway, exchange: Exchange, content: bytes, state: RequestState, stream: bool,
                  drop_usage: bool) -> Response:
    upstream = exchange.upstream = await _open(gateway, exchange, content, state)
    if stream and upstream.response.status == 200:
        return _stream_response(gateway, exchange, upstream, StreamTap(drop_usage_event=drop_usage))
    return await _whole_response(gateway, exchange, upstream)


def _client_left(gateway: Gateway, exchange: Exchange) -> Response:
    """The client left before its answer began: the upstream request was cancelled, so the backend aborts it.
    Charged its prompt, as a stream cut short before its first token."""
    backend = exchange.upstream.backend.shown_url if exchange.upstream else "none"
    gateway.metrics.requests.labels(backend, CLIENT_GONE).inc()
    if exchange.reservation is not None:
        _refund(gateway, exchange.reservation, exchange.reservation.prompt_tokens)
    return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; nginx's code in case a log does


async def _read_state(gateway: Gateway, presented: tuple[str, KeyRecord] | None, turn: ConversationTurn | None,
                      session_id: str | None, block_hashes: list[str], cost: TokenCost
                      ) -> tuple[RequestState, KeyRecord | None, LimitState | None, TokenReservation | None]:
    """The one store round trip before routing, and what it decides: (state, the key as stored now, its limits,
    the tokens reserved for the request); a 401 if the key was revoked meanwhile, a 429 over its limits."""
    key = presented[1] if presented else None
    query = StateQuery(key_id=key.key_id if key else None, session_id=session_id,
                       conversation_id=turn.conversation_id if turn else None)
    reset_s = limits.ask_limits(query, key, cost) if key else 0.0
    if gateway.router.wants_prefix_lookup(session_id):
        query.prefix_hashes = block_hashes
    state = await gateway.store.read_request_state(query)
    if presented is None:
        return state, None, None, None
    reservation = limits.reservation_of(query, state)
    try:
        key = recheck_key(gateway, presented[0], state)
        return state, key, check_limits(gateway, key, state, reset_s, cost), reservation
    except APIError:
        _refund(gateway, reservation)  # refused: nothing will be served
        raise


async def _open(gateway: Gateway, exchange: Exchange, content: bytes, known: RequestState) -> Upstream:
    headers = {"content-type": "application/json"}  # and each backend's own credentials (backend_auth)
    try:
        return await open_upstream(gateway.http, gateway.router, gateway.metrics, gateway.settings.retry,
                                   exchange.path, content, headers, exchange.session_id, exchange.block_hashes,
                                   known)
    except UpstreamFailed as exc:
        _refund(gateway, exchange.reservation)  # no backend took it: nothing was served
        gateway.metrics.requests.labels("none", UNAVAILABLE).inc()
        raise APIError(503, f"no backend could take the request: {exc}", type=SERVER_ERROR,
                       code="no_backend_available", headers={"Retry-After": "1"}) from None
    except aiohttp.ClientError as exc:  # after the backend may have started on it (a read timeout): not resent
        gateway.metrics.requests.labels("none", BACKEND_ERROR).inc()
        raise APIError(502, f"a backend failed before answering: {type(exc).__name__}", type=SERVER_ERROR,
                       code="backend_error") from None


async def _whole_response(gateway: Gateway, exchange: Exchange, upstream: Upstream) -> Response:
    try:
        content = await upstream.response.read()
    except aiohttp.ClientError as exc:
        gateway.metrics.requests.labels(upstream.backend.shown_url, BACKEND_ERROR).inc()
        raise APIError(502, f"backend {upstream.backend.shown_url} failed while answering: {type(exc).__name__}",
                       type=SERVER_ERROR, code="backend_error") from None
    finally:
        await upstream.close()
    status = upstream.response.status
    if status == 200:
        completion = _json_or_none(content)
        _observe_cache(gateway, exchange, upstream, (completion or {}).get("usage"))
        await _record_turn(gateway, exchange, answer_of(completion) if completion else None)
        # Counted once the answer is sent (a store round trip the client need not wait for); the next
        # turn of a conversation, by contrast, must find this one stored, so that is awaited above.
        count_tokens = BackgroundTask(_settle_tokens, gateway, exchange, _total_tokens(completion))
    else:  # the backend refused it or failed: no tokens were served
        count_tokens = BackgroundTask(_settle_tokens, gateway, exchange, 0)
    gateway.metrics.requests.labels(upstream.backend.shown_url, _outcome(status)).inc()
    media_type = upstream.response.headers.get("content-type", "application/json")
    return Response(content, status_code=status, media_type=media_type, headers=exchange.response_headers(upstream),
                    background=count_tokens)


def _stream_response(gateway: Gateway, exchange: Exchange, upstream: Upstream, tap: StreamTap) -> Response:
    outcome = [CLIENT_GONE]  # until the stream ends one way or the other

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in sse_events(upstream.response.content.iter_any()):  # each chunk as it arrives
                if tap.read(event):
                    yield event
        except aiohttp.ClientError as exc:
            # Too late to retry: tokens reached the client. Say so in the stream, as the engine itself would.
            outcome[0] = BACKEND_ERROR
            error = APIError(502, f"backend {upstream.backend.shown_url} failed mid-stream: {type(exc).__name__}",
                             type=SERVER_ERROR, code="backend_error")
            yield f"data: {json.dumps(error.envelope())}\n\n".encode()
            return
        outcome[0] = SUCCESS if tap.done else BACKEND_ERROR

    async def on_close() -> None:
        await upstream.close()
        if outcome[0] == BACKEND_ERROR:
            upstream.backend.breaker.on_failure()
        gateway.metrics.requests.labels(upstream.backend.shown_url, outcome[0]).inc()
        await _settle_tokens(gateway, exchange, _stream_tokens(exchange, tap))
        if tap.done:
            _observe_cache(gateway, exchange, upstream, tap.usage)
            try:
                await _record_turn(gateway, exchange, tap.text)
            except StoreUnavailable as exc:  # the answer has reached the client; only the record is lost
                logger.warning("could not store a streamed turn: %s", exc)

    headers = {**SSE_HEADERS, **exchange.response_headers(upstream)}
    return UpstreamStreamResponse(events(), headers, on_close)


def _observe_cache(gateway: Gateway, exchange: Exchange, upstream: Upstream, usage: object) -> None:
    if gateway.router.observe_cache(upstream.decision, exchange.block_hashes, *cache_counts(usage)):
        gateway.metrics.prefix_expiries.labels(upstream.backend.shown_url, "missed").inc()


async def _record_turn(gateway: Gateway, exchange: Exchange, answer: str | None) -> None:
    if exchange.turn is not None and answer is not None:
        await record_turn(gateway.store, exchange.turn, answer)


async def _settle_tokens(gateway: Gateway, exchange: Exchange, used_tokens: int | None) -> None:
    """`used_tokens` None: the answer said nothing of its usage, so the reservation stands."""
    if exchange.reservation is not None and used_tokens is not None:
        try:
            await limits.settle(gateway.store, exchange.reservation, used_tokens)
        except StoreUnavailable as exc:  # after the answer: the reservation stands, the answer was not lost
            logger.warning("could not settle a request's tokens: %s", exc)


def _refund(gateway: Gateway, reservation: TokenReservation | None, used_tokens: int = 0) -> None:
    """Gives back what a request reserved beyond `used_tokens` (none: it will be served nothing), in the
    background: it is answered now."""
    if reservation is not None:
        spawn(limits.settle(gateway.store, reservation, used_tokens))


def _stream_tokens(exchange: Exchange, tap: StreamTap) -> int | None:
    """A stream's tokens: its usage when it came; else (cut short) its prompt and the text chunks sent, within
    what was reserved."""
    if tap.usage is not None:
        return tap.total_tokens
    if exchange.reservation is None:
        return None
    return min(exchange.reservation.reserved, exchange.reservation.prompt_tokens + tap.text_chunks)


def _outcome(status: int) -> str:
    return SUCCESS if status < 400 else CLIENT_ERROR if status < 500 else BACKEND_ERROR


def _header_session(request: Request, scope: str) -> str | None:
    # Namespaced like users and conversations, so a header can never claim a conversation's session.
    value = request.headers.get(SESSION_HEADER)
    return f"header:{scope}{value}" if value else None


def _user_of(body: dict, scope: str) -> str | None:
    user = body.get("user")
    return f"user:{scope}{user}" if isinstance(user, str) and user else None


def _asked_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _json_or_none(content: bytes) -> dict | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _total_tokens(completion: dict | None) -> int | None:
    usage = (completion or {}).get("usage")
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and total >= 0 else None
