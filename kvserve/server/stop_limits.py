"""Bounds on `stop` and `stop_token_ids`: the engine searches every stop string after every generated token of
every choice, on its own thread, so an unbounded list in one body slows every tenant's request.

OpenAI accepts 4 stop strings; vLLM sets no limit, and clients written for it (evaluation harnesses, agent
frameworks) often send more than 4, so the cap leaves room for them while keeping the per-token work small.
"""

from __future__ import annotations

from kvserve.server.errors import bad_request
from kvserve.server.protocol import SamplingFields

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def check_stop_limits(request: SamplingFields, vocab_size: int) -> None:
    _check_stop_strings(request.stop)
    _check_stop_token_ids(request.stop_token_ids, vocab_size)


def _check_stop_strings(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings are accepted (OpenAI accepts 4), "
                          f"got {len(stops)}", param="stop")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise bad_request(f"stop: each stop string may be at most {MAX_STOP_STRING_CHARS} characters, "
                          f"got one of {len(longest)}", param="stop")


def _check_stop_token_ids(stop_token_ids: list[int] | None, vocab_size: int) -> None:
    token_ids = stop_token_ids or []
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids are accepted, "
                          f"got {len(token_ids)}", param="stop_token_ids")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids: token id {bad} is out of vocabulary (0..{vocab_size - 1})",
                          param="stop_token_ids")
