"""Tokens per word of the synthetic text on the target's tokenizer, measured by asking the server.

Two probes, A and A+B, with `max_tokens` 1: their usage.prompt_tokens differ by the tokens of B alone, whatever
the chat template or BOS adds. Probes shrink when the server refuses them (a small --max-model-len); a server
that does not answer at all (down, stalled) is not probed further: the run itself will report it.
"""

from __future__ import annotations

import random

import httpx

from kvserve.bench.client import CHAT, Target
from kvserve.bench.text import random_words

PROBE_WORDS = 128
MAX_PROBE_TIMEOUT_S = 60.0
MIN_PROBE_WORDS = 4


async def measure_tokens_per_word(http: httpx.AsyncClient, target: Target, timeout_s: float) -> float | None:
    """None when the server does not report usage.prompt_tokens or refuses even tiny probes."""
    rng = random.Random("kvserve-bench-calibration")  # its own stream: probes never share text with the run
    num_words = PROBE_WORDS
    try:
        while num_words >= MIN_PROBE_WORDS:
            first, second = random_words(rng, num_words), random_words(rng, num_words)
            tokens_first = await prompt_tokens(http, target, first, timeout_s)
            tokens_both = await prompt_tokens(http, target, first + " " + second, timeout_s)
            if tokens_first is not None and tokens_both is not None and tokens_both > tokens_first:
                return (tokens_both - tokens_first) / num_words
            num_words //= 2
    except (httpx.HTTPError, ValueError):
        return None
    return None


async def prompt_tokens(http: httpx.AsyncClient, target: Target, text: str, timeout_s: float) -> int | None:
    """None when the server refuses the probe; raises when it does not answer."""
    body: dict = {"model": target.model, "max_tokens": 1, "temperature": 0.0}
    if target.endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    response = await http.post(target.url, json=body, headers=target.headers(), timeout=timeout_s)
    if response.status_code != 200:
        return None
    usage = response.json().get("usage") or {}
    value = usage.get("prompt_tokens")
    return int(value) if value is not None else None
