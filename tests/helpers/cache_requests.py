"""The request as the KV cache manager sees it: ids, tokens, salt and the block hashes it keeps on the request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_prompt_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0  # the scheduler's view, not the manager's
    last_step_start: int = 0  # num_computed_tokens when its last step was allocated (what a window group frees by)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)
