"""How the gateway proves itself to a backend. A backend URL's own `user:password@` is HTTP basic auth for that
backend alone (a reverse proxy in front of it, say); `--backend-api-key` is the bearer key of the backends whose URL
carries none (engines started with `--api-key`). One request has one Authorization header, so a backend never gets
both: the credentials written into its own URL are the more specific choice and win. The URL the requests go to
has its credentials taken out (an HTTP client refuses a URL's credentials beside an Authorization header)."""

from __future__ import annotations

import base64
from urllib.parse import unquote, urlsplit, urlunsplit


def backend_credentials(url: str, api_key: str | None) -> tuple[str, dict[str, str]]:
    """(the URL to send requests to, the headers that authenticate them) for a backend's normalized URL."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    netloc = parts.netloc.rpartition("@")[2]
    plain_url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return plain_url, {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}


def uses_own_credentials(url: str, api_key: str | None) -> bool:
    """Whether --backend-api-key is given but not sent to this backend (its URL has credentials of its own)."""
    parts = urlsplit(url)
    return bool(api_key) and (parts.username is not None or parts.password is not None)
