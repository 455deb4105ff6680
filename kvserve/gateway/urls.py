"""URLs as the gateway shows them: in logs, metrics, headers and error messages a URL's password is masked
(`redis://:***@host:6379/0`, `http://user:***@host:8000`), since all of those reach people and systems that
must not learn it."""

from __future__ import annotations

import re

# scheme://userinfo@ : the userinfo runs to the authority's last "@" (a password may hold an unescaped one).
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#]*)@")


def redacted_url(url: str) -> str:
    match = _USERINFO.match(url)
    if match is None:
        return url
    user, has_password, _ = match["userinfo"].partition(":")
    # Without a colon the one part may be a password (redis://secret@host is often meant so): masked whole.
    masked = f"{user}:***" if has_password else "***"
    return f"{match['scheme']}{masked}@{url[match.end():]}"
