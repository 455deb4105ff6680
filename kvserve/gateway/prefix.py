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


def prefix_block_hashes(body: dict, block_chars: int = DEFAULT_BLOCK_CHARS) -> list[str]:
    """Chained hashes of the full blocks of the prompt, salted with the model so two models never share."""
    text = canonical_prompt(body)
    parent = hashlib.blake2b(str(body.get("model")).encode(), digest_size=16).digest()
    hashes: list[str] = []
    for start in range(0, min(len(text), block_chars * MAX_BLOCKS) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + text[start:start + block_chars].encode(), digest_size=16).digest()
        hashes.append(parent.hex())
    return hashes


def longest_match(block_backends: list[str | None]) -> tuple[str | None, int]:
    """(backend, blocks matched) for the deepest block of the unbroken leading chain that some backend served:
    that backend served the longest prefix most recently."""
    depth = 0
    while depth < len(block_backends) and block_backends[depth] is not None:
        depth += 1
    return (block_backends[depth - 1], depth) if depth else (None, 0)
