"""Prompt-prefix blocks as the gateway can see them: it has no tokenizer (backends may serve any model), so a
prompt is cut into fixed-size blocks of characters of a canonical rendering, each block's hash chained to the
one before it, as the engine chains its token blocks. Two prompts share a leading chain exactly when they share a
leading run of text, which is when the engine's prefix cache can hit for one after the other.
"""

from __future__ import annotations

import hashlib
import json

DEFAULT_BLOCK_CHARS = 256
MAX_BLOCKS = 64  # past 16K characters the deeper blocks add nothing to a routing decision


def canonical_prompt(body: dict) -> str:
    """The prompt's text in a form that does not depend on JSON formatting: chat messages role and content
    one after another (the order a chat template renders them), or a completion prompt as given."""
    if "messages" in body:
        parts = [json.dumps([m.get("role"), m.get("content")], ensure_ascii=False, separators=(",", ":"))
                 for m in body.get("messages") or [] if isinstance(m, dict)]
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


def prefix_block_hashes(body: dict, block_chars: int = DEFAULT_BLOCK_CHARS,
                        cache_salt: str | None = None) -> list[str]:
    """Chained hashes of the full blocks of the prompt, salted with the model so two models never share, and with
    the request's cache salt as the backend's blocks are (one key's prompts never route another's)."""
    text = canonical_prompt(body)
    scope = str(body.get("model")) if cache_salt is None else f"{body.get('model')}\0{cache_salt}"
    parent = hashlib.blake2b(scope.encode(), digest_size=16).digest()
    hashes: list[str] = []
    for start in range(0, min(len(text), block_chars * MAX_BLOCKS) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + text[start:start + block_chars].encode(), digest_size=16).digest()
        hashes.append(parent.hex())
    return hashes


# A block's entry in the index: the backend that last served a prompt through it, and when (time.time()).
PrefixEntry = tuple[str, float]


def longest_match(entries: list[PrefixEntry | None]) -> tuple[PrefixEntry | None, int]:
    """(entry, blocks matched) for the deepest block of the unbroken leading chain that some backend served:
    that backend served the longest prefix most recently."""
    depth = 0
    while depth < len(entries) and entries[depth] is not None:
        depth += 1
    return (entries[depth - 1], depth) if depth else (None, 0)


def live_entries(values: list[str | None], horizons: dict[str, str]) -> list[PrefixEntry | None]:
    """Stored 'backend seen' values as entries, None where absent or at/before the backend's cache horizon (an
    entry of an older gateway, a bare URL, counts as seen at 0)."""
    entries: list[PrefixEntry | None] = []
    for value in values:
        backend, _, seen_text = (value or "").partition(" ")
        seen = float(seen_text or 0.0)
        alive = bool(backend) and seen > float(horizons.get(backend, 0.0))
        entries.append((backend, seen) if alive else None)
    return entries


# A `prefix` decision missed when the backend reports under this share of the cached tokens the match promised.
MISSED_SHARE = 0.5


def prefix_missed(depth: int, num_blocks: int, prompt_tokens: int | None, cached_tokens: int | None) -> bool:
    """Whether the backend's cached_tokens fall well short of the `depth` blocks the index matched out of the
    prompt's `num_blocks` (blocks are characters and the backend counts tokens, so the promise is a share of the
    prompt). No usage, no verdict."""
    if prompt_tokens is None or cached_tokens is None or not depth or not num_blocks or prompt_tokens <= 0:
        return False
    promised = prompt_tokens * min(1.0, depth / num_blocks)
    return cached_tokens < MISSED_SHARE * promised


def cache_counts(usage: object) -> tuple[int | None, int | None]:
    """(prompt_tokens, cached_tokens) of an OpenAI usage object; None for what it does not say."""
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens")
    return (prompt if isinstance(prompt, int) else None), (cached if isinstance(cached, int) else None)
