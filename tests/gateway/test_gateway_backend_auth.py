"""How the gateway authenticates to its backends, checked by real HTTP backends that refuse any other header: a
backend URL's own `user:password@` is basic auth for that backend alone, `--backend-api-key` the bearer key of the
others, in the start-up check, the health checks, the models list and completions alike; a backend never gets both
(aiohttp refused such a request outright)."""

from __future__ import annotations

import base64

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway_harness import start_gateway
from server_harness import serve_in_thread

COMPLETION = {"id": "cmpl-auth", "object": "text_completion", "model": "stub",
              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class GuardedBackend:
    """A backend that answers only requests carrying `expected` as their Authorization header (401 otherwise) and
    notes every header it was sent, per path."""

    def __init__(self, expected: str) -> None:
        self.expected = expected
        self.seen: list[tuple[str, str | None]] = []

        def guarded(answer):
            async def endpoint(request: Request) -> Response:
                await request.body()
                header = request.headers.get("authorization")
                self.seen.append((request.url.path, header))
                if header != self.expected:
                    return JSONResponse({"error": {"message": "bad credentials"}}, status_code=401)
                return answer()
            return endpoint

        routes = [Route("/health", guarded(lambda: PlainTextResponse("ok"))),
                  Route("/metrics", guarded(lambda: PlainTextResponse(""))),
                  Route("/v1/models", guarded(lambda: JSONResponse({"object": "list", "data": []}))),
                  Route("/v1/completions", guarded(lambda: JSONResponse(COMPLETION)), methods=["POST"])]
        self.url, self.server, self.thread = serve_in_thread(Starlette(routes=routes), shutdown_timeout_s=1.0)

    def headers_seen(self) -> set[str | None]:
        return {header for _, header in self.seen}

    def paths_seen(self) -> set[str]:
        return {path for path, _ in self.seen}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_a_urls_credentials_are_its_basic_auth_and_the_api_key_goes_to_the_other_backends(tmp_path):
    from kvserve.cli import build_parser
    from kvserve.gateway.cli import preflight, settings_from_args

    behind_proxy = GuardedBackend(basic("operator", "s3cret:@x"))
    engine = GuardedBackend("Bearer backend-key")
    # The password percent-encoded in the URL, as a URL must carry ':' and '@'.
    urls = [behind_proxy.url.replace("http://", "http://operator:s3cret%3A%40x@"), engine.url]
    args = build_parser().parse_args(["gateway", "--backend", *urls, "--backend-api-key", "backend-key",
                                      "--disable-auth", "--routing", "round-robin",
                                      "--state-path", str(tmp_path / "gw.sqlite3")])
    settings = settings_from_args(args)
    gateway = None
    try:
        preflight(settings)  # `kvserve gateway`'s start-up check: each backend's /health with its credentials
        gateway = start_gateway(settings)
        answered = [httpx.post(f"{gateway.base_url}/completions", timeout=30,
                               json={"model": "stub", "prompt": "hi", "max_tokens": 1}) for _ in range(4)]
        models = httpx.get(f"{gateway.base_url}/models", timeout=30)
    finally:
        if gateway is not None:
            gateway.stop()
        behind_proxy.stop()
        engine.stop()
    assert [response.status_code for response in answered] == [200] * 4, answered[0].text
    assert models.status_code == 200
    assert behind_proxy.headers_seen() == {basic("operator", "s3cret:@x")}
    assert engine.headers_seen() == {"Bearer backend-key"}
    for backend in (behind_proxy, engine):  # round robin: each took completions; both were health-checked
        assert {"/health", "/metrics", "/v1/completions"} <= backend.paths_seen()


def test_the_api_key_alone_goes_to_every_backend_and_credentials_alone_to_theirs():
    from kvserve.gateway.backend_auth import backend_credentials

    assert backend_credentials("http://10.0.0.5:8000", "k") == ("http://10.0.0.5:8000", {"Authorization": "Bearer k"})
    assert backend_credentials("http://10.0.0.5:8000", None) == ("http://10.0.0.5:8000", {})
    assert backend_credentials("https://ops:pw@host", None) == ("https://host", {"Authorization": basic("ops", "pw")})
    assert backend_credentials("http://token@host:1", "k") == ("http://host:1", {"Authorization": basic("token", "")})


def test_a_backend_urls_password_is_sent_but_never_stored(tmp_path):
    from gateway_harness import gateway_settings

    backend = GuardedBackend(basic("operator", "s3cret"))
    url = backend.url.replace("http://", "http://operator:s3cret@")
    state = tmp_path / "state"
    state.mkdir()
    gateway = start_gateway(gateway_settings([url], state_path=str(state / "gw.sqlite3")))
    try:
        body = {"model": "stub", "prompt": "a prompt long enough to record a prefix block " * 8, "max_tokens": 1}
        with_session = httpx.post(f"{gateway.base_url}/completions", json={**body, "user": "alice"}, timeout=30)
        without = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=30)
    finally:
        gateway.stop()  # its background store writes are drained before it stops
        backend.stop()
    assert with_session.status_code == without.status_code == 200
    assert with_session.headers["x-kvserve-backend"] == url.replace("s3cret", "***")
    stored = b"".join(path.read_bytes() for path in state.iterdir())  # the SQLite file, its WAL and index
    assert backend.url.encode() in stored  # the session and the prefix entries name the backend...
    assert b"s3cret" not in stored  # ...without its password
